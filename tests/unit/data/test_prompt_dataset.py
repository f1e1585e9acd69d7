"""Prompt files (JSONL, Parquet; verl and flat layouts), chat template, filtering, row errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from rltrain.data.dataset import PromptDataset
from rltrain.data.prompt_rows import DataRowError, PromptFields, read_prompt_file
from rltrain.models.tiny import build_tiny_tokenizer

VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "Natalia sold 48 clips. #### ?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0},
    },
    {
        "data_source": "arithmetic",
        "prompt": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 12 + 7?"},
        ],
        "reward_model": {"style": "rule", "ground_truth": "19"},
        "extra_info": {"split": "train", "index": 1},
    },
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_verl_layout_jsonl_and_parquet_agree(tmp_path: Path) -> None:
    from_jsonl = read_prompt_file(write_jsonl(tmp_path / "train.jsonl", VERL_ROWS))
    parquet = tmp_path / "train.parquet"
    pd.DataFrame(VERL_ROWS).to_parquet(parquet)
    from_parquet = read_prompt_file(parquet)
    for a, b in zip(from_jsonl, from_parquet, strict=True):
        assert (a.index, a.prompt, a.ground_truth, a.data_source) == (
            b.index,
            b.prompt,
            b.ground_truth,
            b.data_source,
        )
        assert a.extra_info == b.extra_info
    first = from_jsonl[0]
    assert first.prompt == [{"role": "user", "content": "Natalia sold 48 clips. #### ?"}]
    assert (first.ground_truth, first.data_source, first.extra_info) == (
        "72",
        "openai/gsm8k",
        VERL_ROWS[0]["extra_info"],
    )
    assert first.origin == f"{tmp_path / 'train.jsonl'}:1"
    assert from_parquet[1].origin == f"{parquet}: row 1"


def test_flat_layout_and_configured_fields(tmp_path: Path) -> None:
    rows = [
        {"question": "What is 2 + 2?", "answer": 4, "data_source": "arithmetic"},
        {"question": "Hi", "answer": "x"},
    ]
    fields = PromptFields(prompt_key="question", default_data_source="gsm8k")
    examples = read_prompt_file(write_jsonl(tmp_path / "flat.jsonl", rows), fields=fields)
    assert [(e.prompt, e.ground_truth, e.data_source) for e in examples] == [
        ("What is 2 + 2?", "4", "arithmetic"),
        ("Hi", "x", "gsm8k"),
    ]
    dotted = [{"prompt": "p", "meta": {"gold": "7"}, "answer": "wrong", "data_source": "arithmetic"}]
    (example,) = read_prompt_file(
        write_jsonl(tmp_path / "d.jsonl", dotted), fields=PromptFields(answer_key="meta.gold")
    )
    assert example.ground_truth == "7"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"answer": "1", "data_source": "arithmetic"}', "missing key 'prompt'"),
        ('{"prompt": "p", "data_source": "arithmetic"}', "missing ground truth; looked for keys"),
        ('{"prompt": "p", "answer": "1"}', "missing key 'data_source' (and no default_data_source)"),
        (
            '{"prompt": "p", "answer": [1], "data_source": "a"}',
            "ground truth 'answer' must be a string or a number",
        ),
        ('{"prompt": [{"role": "user"}], "answer": "1", "data_source": "a"}', "prompt[0] must be a message"),
        ('{"prompt": 5, "answer": "1", "data_source": "a"}', "must be a string or a non-empty list"),
        ('{"prompt": "  ", "answer": "1", "data_source": "a"}', "empty prompt"),
        (
            '{"prompt": "p", "answer": "1", "data_source": "a", "extra_info": 3}',
            "'extra_info' must be an object",
        ),
        ('{"prompt": "p", "answer": "1", ', "invalid JSON"),
        ("[1, 2]", "a row must be a JSON object, got list"),
    ],
)
def test_malformed_jsonl_row_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "train.jsonl"
    good = json.dumps({"prompt": "ok", "answer": "1", "data_source": "arithmetic"})
    path.write_text(f"{good}\n\n{good}\n{line}\n")  # the blank line 2 still counts
    with pytest.raises(DataRowError) as err:
        read_prompt_file(path)
    assert str(err.value).startswith(f"{path}:4: ")
    assert message in str(err.value)


def test_malformed_parquet_row_names_file_and_row(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    pd.DataFrame({"prompt": ["fine", None], "answer": ["1", "2"], "data_source": ["a", "a"]}).to_parquet(path)
    with pytest.raises(DataRowError, match=r"bad\.parquet: row 1: key 'prompt' must be a string"):
        read_prompt_file(path)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(DataRowError, match=r"prompt file not found: .*nope\.jsonl"):
        read_prompt_file(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("prompt\n")
    with pytest.raises(ValueError, match=r"x\.csv: unsupported prompt file type '\.csv'"):
        read_prompt_file(tmp_path / "x.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataRowError, match=r"empty\.jsonl: no rows"):
        read_prompt_file(tmp_path / "empty.jsonl")


def test_chat_template_ids_match_hf_and_hand_rendered_text(tmp_path: Path, tokenizer) -> None:
    dataset = PromptDataset.load(
        write_jsonl(tmp_path / "t.jsonl", VERL_ROWS), tokenizer, max_prompt_length=512
    )
    second = dataset[1]
    assert second.prompt_text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
    )
    reference = tokenizer.apply_chat_template(
        VERL_ROWS[1]["prompt"], add_generation_prompt=True, tokenize=True
    )
    assert second.prompt_ids == list(reference["input_ids"])
    assert tokenizer.decode(second.prompt_ids) == second.prompt_text


def test_string_prompt_with_and_without_chat_template(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(
        tmp_path / "raw.jsonl", [{"prompt": "What is 3 * 4?", "answer": "12", "data_source": "a"}]
    )
    chat = PromptDataset.load(path, tokenizer, max_prompt_length=512)[0]
    assert chat.prompt_text == "<|im_start|>user\nWhat is 3 * 4?<|im_end|>\n<|im_start|>assistant\n"
    raw = PromptDataset.load(path, tokenizer, max_prompt_length=512, apply_chat_template=False)[0]
    assert raw.prompt_text == "What is 3 * 4?"
    assert raw.prompt_ids == tokenizer("What is 3 * 4?")["input_ids"]
    messages = write_jsonl(tmp_path / "m.jsonl", VERL_ROWS)
    with pytest.raises(
        DataRowError, match=r"m\.jsonl:1: prompt is a chat message list but apply_chat_template is off"
    ):
        PromptDataset.load(messages, tokenizer, max_prompt_length=512, apply_chat_template=False)


def test_overlong_prompts_are_filtered_and_counted(tmp_path: Path, tokenizer, caplog) -> None:
    rows = [{"prompt": "word " * n, "answer": str(n), "data_source": "a"} for n in (1, 30, 2, 50, 3)]
    path = write_jsonl(tmp_path / "lens.jsonl", rows)
    lengths = [
        len(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for r in rows
    ]
    limit = sorted(lengths)[2]  # keeps exactly the three shortest prompts
    with caplog.at_level(logging.WARNING, logger="rltrain.data.dataset"):
        dataset = PromptDataset.load(path, tokenizer, max_prompt_length=limit)
    assert [e.ground_truth for e in dataset] == ["1", "2", "3"]
    assert [e.index for e in dataset] == [0, 2, 4]
    assert dataset.num_filtered == 2 and len(dataset) == 3
    assert all(len(e.prompt_ids) <= limit for e in dataset)
    assert f"filtered 2 of 5 prompts longer than max_prompt_length={limit}" in caplog.text
    with pytest.raises(DataRowError) as err:
        PromptDataset.load(path, tokenizer, max_prompt_length=1)
    assert str(err.value) == (
        f"{path}: all 5 prompts exceed data.max_prompt_length=1 tokens "
        f"(the shortest has {min(lengths)}, chat template included)"
    )


def test_several_files_are_concatenated_with_running_indices(tmp_path: Path, tokenizer) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", VERL_ROWS)
    b = tmp_path / "b.parquet"
    pd.DataFrame(VERL_ROWS[:1]).to_parquet(b)
    dataset = PromptDataset.load([a, b], tokenizer, max_prompt_length=512)
    assert [(e.index, e.origin) for e in dataset] == [(0, f"{a}:1"), (1, f"{a}:2"), (2, f"{b}: row 0")]
    assert dataset.num_filtered == 0


def test_json_array_and_json_lines_files(tmp_path: Path) -> None:
    array = tmp_path / "rows.json"
    array.write_text(json.dumps(VERL_ROWS, indent=2))
    lines = write_jsonl(tmp_path / "lines.json", VERL_ROWS)
    from_array, from_lines = read_prompt_file(array), read_prompt_file(lines)
    assert [e.ground_truth for e in from_array] == [e.ground_truth for e in from_lines] == ["72", "19"]
    assert [e.origin for e in from_array] == [f"{array}: row 0", f"{array}: row 1"]
    assert from_lines[1].origin == f"{lines}:2"
    broken = tmp_path / "broken.json"
    broken.write_text('[\n  {"prompt": "p",\n  oops\n]')
    with pytest.raises(DataRowError, match=r"broken\.json:3: invalid JSON"):
        read_prompt_file(broken)


def test_in_memory_rows_name_their_source(tokenizer) -> None:
    rows = [
        {"prompt": "What is 1 + 1?", "answer": "2", "data_source": "arithmetic"},
        {"prompt": "x", "data_source": "arithmetic"},
    ]
    with pytest.raises(DataRowError, match=r"^generated/train: row 1: missing ground truth"):
        PromptDataset.from_rows(rows, tokenizer, name="generated/train", max_prompt_length=64)
    dataset = PromptDataset.from_rows(rows[:1], tokenizer, name="generated/train", max_prompt_length=64)
    assert dataset[0].prompt_text == "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    assert (dataset.name, dataset.num_filtered) == ("generated/train", 0)


def test_tokenizer_without_chat_template_is_named(tmp_path: Path) -> None:
    plain = build_tiny_tokenizer()
    plain.chat_template = None
    path = write_jsonl(tmp_path / "t.jsonl", VERL_ROWS)
    with pytest.raises(ValueError, match=r"t\.jsonl: the tokenizer has no chat template"):
        PromptDataset.load(path, plain, max_prompt_length=64)
