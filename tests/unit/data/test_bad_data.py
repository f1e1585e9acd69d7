"""Bad prompt data fails when it loads, in one line naming the file and line: bytes that are not
UTF-8, unreadable Parquet, prompts all longer than data.max_prompt_length, fewer prompts than one
batch. Every such error is a ConfigError (the command line prints it without a traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rltrain.config import ConfigError
from rltrain.data.dataset import PromptDataset
from rltrain.data.loader import PromptLoader
from rltrain.data.prompt_rows import DataRowError, read_prompt_file
from rltrain.models.tiny import build_tiny_tokenizer

ROW = {"prompt": "What is 1 + 1?", "answer": "2", "data_source": "arithmetic"}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def error_of(call, *args, **kwargs) -> str:
    with pytest.raises(DataRowError) as err:
        call(*args, **kwargs)
    assert isinstance(err.value, ConfigError)
    return str(err.value)


def test_non_utf8_byte_in_jsonl_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    good = json.dumps(ROW).encode()
    path.write_bytes(good + b"\n\n" + b'{"prompt": "caf\xe9"}\n')
    assert error_of(read_prompt_file, path) == f"{path}:3: not UTF-8 text (byte 0xe9 at column 16)"


def test_non_utf8_byte_in_a_json_array_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    path.write_bytes(b'[\n  {"prompt": "ok"},\n  {"prompt": "\xff"}\n]')
    assert error_of(read_prompt_file, path) == f"{path}:3: not UTF-8 text (byte 0xff at column 15)"


def test_unreadable_parquet_is_named(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    path.write_bytes(b"not parquet at all")
    assert error_of(read_prompt_file, path).startswith(f"{path}: not a readable Parquet file (")


def test_prompt_length_that_leaves_no_prompt_names_the_key_and_the_shortest(tmp_path, tokenizer) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + json.dumps({**ROW, "prompt": "What is 10 + 11 + 12?"}) + "\n")
    shortest = len(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": ROW["prompt"]}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
    )
    message = error_of(PromptDataset.load, path, tokenizer, max_prompt_length=shortest - 1)
    assert message == (
        f"{path}: all 2 prompts exceed data.max_prompt_length={shortest - 1} tokens "
        f"(the shortest has {shortest}, chat template included)"
    )
    assert len(PromptDataset.load(path, tokenizer, max_prompt_length=shortest)) == 1


def test_fewer_prompts_than_one_batch_names_the_files_and_the_batch_key(tmp_path, tokenizer) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(ROW) + "\n")
    b.write_text(json.dumps(ROW) + "\n" + json.dumps({**ROW, "prompt": "word " * 200}) + "\n")
    dataset = PromptDataset.load([a, b], tokenizer, max_prompt_length=64)
    assert error_of(PromptLoader, dataset, 4, seed=0) == (
        f"{a},{b}: 2 prompts (1 longer than data.max_prompt_length dropped), "
        "fewer than one batch (data.train_batch_size=4)"
    )
    assert len(PromptLoader(dataset, 2, seed=0)) == 1


def test_a_run_checks_its_data_when_it_loads_it(tmp_path, tokenizer) -> None:
    """``build_data`` (what ``rltrain train`` runs before starting Ray and the workers) applies every
    load-time check: here the rewards' data_source check and the one-batch check."""
    from rltrain.config import load_config
    from rltrain.rewards import registered_data_sources
    from rltrain.trainer.run import build_data

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(ROW) + "\n" + json.dumps({**ROW, "data_source": "gsm9k"}) + "\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {{tiny: {{}}}}\ndata: {{train_files: ['{data}'], train_batch_size: 2}}\n"
        "actor: {ppo_mini_batch_size: 2, ppo_micro_batch_size_per_gpu: 2}\n"
        "critic: {ppo_micro_batch_size_per_gpu: 2}\n"
    )
    with pytest.raises(DataRowError) as err:
        build_data(load_config(recipe), tokenizer)
    assert str(err.value) == (
        f"{data}:2: no reward function registered for data_source 'gsm9k'; registered: "
        f"{registered_data_sources()}; map other names with reward.source_overrides"
    )
    mapped = ["reward.source_overrides={gsm9k: arithmetic}"]
    assert len(build_data(load_config(recipe, mapped), tokenizer).train) == 1
    bigger = [*mapped, "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"]
    with pytest.raises(DataRowError) as err:
        build_data(load_config(recipe, bigger), tokenizer)
    assert str(err.value) == f"{data}: 2 prompts, fewer than one batch (data.train_batch_size=4)"
