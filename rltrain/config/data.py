"""Prompt data: files or a generated task, batch size, prompt length."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rltrain.config.fields import NonNegativeInt, PositiveInt


@dataclass
class GeneratedTaskConfig:
    name: Literal["arithmetic", "calculator"] = "arithmetic"
    """Built-in verifiable task generated at start-up (no files needed): ``arithmetic`` asks for the
    number only; ``calculator`` asks the same problems of a model with the calculator tool (the
    multi-turn recipe)."""

    num_train: PositiveInt = 1024
    """Training prompts to generate."""

    num_val: NonNegativeInt = 64
    """Held-out prompts to generate for evaluation."""

    max_operand: NonNegativeInt = 20
    """Operands are drawn from [0, max_operand]."""

    ops: list[Literal["+", "-", "*"]] = field(default_factory=lambda: ["+", "-"])
    """Operators to draw from."""

    seed: int = 1234
    """Seed of the generator (train and val are disjoint draws of one stream)."""

    def validate(self, prefix: str) -> list[str]:
        problems = []
        if not self.ops:
            problems.append(f"{prefix}.ops is empty: name at least one operator")
        space = (self.max_operand + 1) ** 2 * len(self.ops)
        if self.ops and self.num_train + self.num_val > space:
            problems.append(
                f"{prefix}.num_train + {prefix}.num_val = {self.num_train + self.num_val} exceeds the "
                f"{space} distinct problems of {prefix}.max_operand={self.max_operand} and "
                f"{prefix}.ops={list(self.ops)}"
            )
        return problems


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """JSONL or Parquet prompt files for training (verl layout or flat; see rltrain/data/prompt_rows.py)."""

    val_files: list[str] = field(default_factory=list)
    """Held-out prompt files for evaluation every ``trainer.test_freq`` steps."""

    generated: GeneratedTaskConfig | None = None
    """Generate the prompts instead of reading files (mutually exclusive with ``train_files``)."""

    prompt_key: str = "prompt"
    """Row key holding the prompt: a string, or a list of chat messages."""

    answer_key: str | None = None
    """Dotted row key of the ground-truth answer; null tries ``reward_model.ground_truth`` (verl's
    layout), then ``ground_truth``, then ``answer``."""

    train_batch_size: PositiveInt = 256
    """Prompts per PPO step (each is sampled ``rollout.n`` times)."""

    gen_batch_size: PositiveInt | None = None
    """Prompts drawn and generated per round of dynamic sampling (``algorithm.filter_groups``); at
    least ``train_batch_size``. Null: ``train_batch_size``. Only with ``filter_groups.enable``."""

    val_batch_size: PositiveInt | None = None
    """Prompts per evaluation batch; null evaluates the whole validation set at once."""

    max_prompt_length: PositiveInt = 512
    """Prompts longer than this many tokens (after the chat template) are dropped and counted."""

    apply_chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template (with the generation prompt)."""

    shuffle: bool = True
    """Shuffle the prompts each epoch with a permutation derived from ``seed`` and the epoch."""

    seed: int = 1
    """Seed of the shuffling."""

    def validate(self, prefix: str) -> list[str]:
        problems = []
        if self.generated is None and not self.train_files:
            problems.append(f"set {prefix}.train_files or {prefix}.generated")
        if self.generated is not None and self.train_files:
            problems.append(f"{prefix}.train_files and {prefix}.generated are mutually exclusive")
        for key in ("train_files", "val_files"):
            for i, path in enumerate(getattr(self, key)):
                if not path.endswith((".jsonl", ".json", ".parquet")):
                    problems.append(f"{prefix}.{key}[{i}]: {path!r} is not a .jsonl, .json or .parquet file")
        if self.generated is not None:
            problems += self.generated.validate(f"{prefix}.generated")
            if self.generated.num_train < self.train_batch_size:
                problems.append(
                    f"{prefix}.generated.num_train={self.generated.num_train} is fewer prompts than one "
                    f"batch ({prefix}.train_batch_size={self.train_batch_size})"
                )
        return problems
