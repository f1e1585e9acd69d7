"""The generated arithmetic task: determinism, distinct problems, correct answers, split files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rltrain.data.dataset import PromptDataset
from rltrain.data.tasks import arithmetic_splits, generate_arithmetic, write_arithmetic_splits
from rltrain.models.tiny import build_tiny_tokenizer
from rltrain.rewards import RewardManager

PROMPT = re.compile(r"What is (\d+) ([-+*]) (\d+)\? Answer with the number only\.")


def solve(content: str) -> int:
    """Independent reference: parse the prompt text and compute the answer by hand."""
    a, op, b = PROMPT.fullmatch(content).groups()
    a, b = int(a), int(b)
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def test_rows_are_verl_layout_with_correct_integer_answers() -> None:
    rows = generate_arithmetic(200, seed=3, max_operand=30)
    for i, row in enumerate(rows):
        content = row["prompt"][0]["content"]
        assert row["prompt"][0]["role"] == "user" and len(row["prompt"]) == 1
        assert row["data_source"] == "arithmetic"
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(solve(content))}
        assert row["extra_info"]["index"] == i
        a, op, b = PROMPT.fullmatch(content).groups()
        assert 0 <= int(a) <= 30 and 0 <= int(b) <= 30
        assert row["extra_info"]["expression"] == f"{a} {op} {b}"
    assert len({r["extra_info"]["expression"] for r in rows}) == 200


def test_deterministic_per_seed() -> None:
    assert generate_arithmetic(50, seed=7) == generate_arithmetic(50, seed=7)
    assert generate_arithmetic(50, seed=7) != generate_arithmetic(50, seed=8)


def test_whole_problem_space_is_enumerated_once() -> None:
    rows = generate_arithmetic(18, seed=0, max_operand=2, ops=("+", "*"))
    expected = {f"{a} {op} {b}" for a in range(3) for b in range(3) for op in "+*"}
    assert sorted(r["extra_info"]["expression"] for r in rows) == sorted(expected)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"num_examples must lie in \[1, 18\]"):
        generate_arithmetic(19, seed=0, max_operand=2, ops=("+", "*"))
    with pytest.raises(ValueError, match=r"non-empty subset of \['\+', '-', '\*'\], got \['/'\]"):
        generate_arithmetic(3, seed=0, ops=("/",))


def test_split_files_are_disjoint_and_score_their_own_answers(tmp_path: Path) -> None:
    train, val = write_arithmetic_splits(tmp_path / "arith", num_train=40, num_val=10, seed=1)
    assert (train.name, val.name) == ("train.jsonl", "val.jsonl")
    tokenizer = build_tiny_tokenizer()
    train_ds = PromptDataset.load(train, tokenizer, max_prompt_length=64)
    val_ds = PromptDataset.load(val, tokenizer, max_prompt_length=64)
    assert (len(train_ds), len(val_ds)) == (40, 10)
    assert {e.extra_info["split"] for e in val_ds} == {"val"}
    assert [e.extra_info["index"] for e in val_ds] == list(range(10))
    train_exprs = {e.extra_info["expression"] for e in train_ds}
    assert train_exprs.isdisjoint(e.extra_info["expression"] for e in val_ds)
    out = RewardManager()(
        [e.ground_truth for e in train_ds],
        ground_truths=[e.ground_truth for e in train_ds],
        data_sources=[e.data_source for e in train_ds],
    )
    assert out.metrics["reward/accuracy"] == 1.0


def test_in_memory_splits_equal_the_written_files(tmp_path: Path) -> None:
    train_rows, val_rows = arithmetic_splits(num_train=6, num_val=3, seed=4, max_operand=9, ops=("+",))
    train, val = write_arithmetic_splits(tmp_path, num_train=6, num_val=3, seed=4, max_operand=9, ops=("+",))
    assert [json.loads(line) for line in train.read_text().splitlines()] == train_rows
    assert [json.loads(line) for line in val.read_text().splitlines()] == val_rows
    dataset = PromptDataset.from_rows(
        val_rows, build_tiny_tokenizer(), name="arithmetic/val", max_prompt_length=64
    )
    assert [e.ground_truth for e in dataset] == [str(solve(r["prompt"][0]["content"])) for r in val_rows]
