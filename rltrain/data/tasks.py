"""Built-in verifiable tasks: a generated arithmetic task for CPU runs, and JSONL writers.

``generate_arithmetic`` draws distinct problems ``a <op> b`` with operands in ``[0, max_operand]``
by sampling indices of the whole problem space without replacement, so a seed fixes the problems
and no problem repeats; ``arithmetic_splits`` (in memory, for
:meth:`rltrain.data.dataset.PromptDataset.from_rows`) and ``write_arithmetic_splits`` (JSONL files
for a recipe) take train and validation from one draw, so the two never overlap. Rows use verl's layout (see :mod:`rltrain.data.prompt_rows`) with
data_source ``arithmetic`` and an integer ground truth (scored by
:func:`rltrain.rewards.math_answers.arithmetic_reward`).

GSM8K is not generated: it comes from files in verl's layout (data_source ``openai/gsm8k``).
"""

from __future__ import annotations

import json
import operator
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ARITHMETIC_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
"""Operators of the arithmetic task."""

ARITHMETIC_TEMPLATE = "What is {a} {op} {b}? Answer with the number only."

CALCULATOR_TEMPLATE = "What is {a} {op} {b}?"
"""The ``calculator`` task: the same problems, to be solved with the calculator tool (data_source
``calculator``, scored on the answer after the last tool call)."""

TASKS = {"arithmetic": ARITHMETIC_TEMPLATE, "calculator": CALCULATOR_TEMPLATE}
"""Generated task name → prompt template (the name is also the rows' data_source)."""


def arithmetic_row(a: int, op: str, b: int, *, index: int, task: str = "arithmetic") -> dict[str, Any]:
    """One arithmetic problem as a row in verl's layout (``task`` picks the prompt and data_source)."""
    answer = ARITHMETIC_OPS[op](a, b)
    return {
        "data_source": task,
        "prompt": [{"role": "user", "content": TASKS[task].format(a=a, op=op, b=b)}],
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"index": index, "expression": f"{a} {op} {b}"},
    }


def generate_arithmetic(
    num_examples: int,
    *,
    seed: int,
    max_operand: int = 20,
    ops: Sequence[str] = ("+", "-", "*"),
    task: str = "arithmetic",
) -> list[dict[str, Any]]:
    """``num_examples`` distinct problems ``a op b`` (0 <= a, b <= ``max_operand``), fixed by ``seed``."""
    unknown = [op for op in ops if op not in ARITHMETIC_OPS]
    if unknown or not ops:
        raise ValueError(
            f"arithmetic ops must be a non-empty subset of {list(ARITHMETIC_OPS)}, got {list(ops)}"
        )
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    num_operands = max_operand + 1
    space = num_operands * num_operands * len(ops)
    if not 0 < num_examples <= space:
        raise ValueError(
            f"num_examples must lie in [1, {space}] (distinct problems with max_operand={max_operand} "
            f"and ops={list(ops)}), got {num_examples}"
        )
    rows = []
    for index, code in enumerate(random.Random(seed).sample(range(space), num_examples)):
        code, a = divmod(code, num_operands)
        op_index, b = divmod(code, num_operands)
        rows.append(arithmetic_row(a, ops[op_index], b, index=index, task=task))
    return rows


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write rows as JSONL (one object per line), creating parent folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


def arithmetic_splits(
    *,
    num_train: int,
    num_val: int,
    seed: int,
    max_operand: int = 20,
    ops: Sequence[str] = ("+", "-", "*"),
    task: str = "arithmetic",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint train and validation rows from one draw; ``extra_info`` gets ``split`` and a per-split index."""
    if num_train < 1 or num_val < 0:
        raise ValueError(f"need num_train >= 1 and num_val >= 0, got {num_train} and {num_val}")
    rows = generate_arithmetic(num_train + num_val, seed=seed, max_operand=max_operand, ops=ops, task=task)
    splits = (rows[:num_train], rows[num_train:])
    for split, part in zip(("train", "val"), splits):
        for i, row in enumerate(part):
            row["extra_info"].update(index=i, split=split)
    return splits


def write_arithmetic_splits(
    out_dir: str | Path,
    *,
    num_train: int,
    num_val: int,
    seed: int,
    max_operand: int = 20,
    ops: Sequence[str] = ("+", "-", "*"),
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``val.jsonl`` of disjoint arithmetic problems; returns both paths."""
    train, val = arithmetic_splits(
        num_train=num_train, num_val=num_val, seed=seed, max_operand=max_operand, ops=ops
    )
    out = Path(out_dir)
    return write_jsonl(train, out / "train.jsonl"), write_jsonl(val, out / "val.jsonl")
