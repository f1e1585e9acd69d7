"""Prompt datasets: rows read from files or memory (:mod:`rltrain.data.prompt_rows`), rendered with a
chat template and tokenized.

Tokenization: with ``apply_chat_template`` (the default) the messages are rendered with the
tokenizer's chat template and ``add_generation_prompt=True`` (a plain-string prompt becomes one
user message), then encoded without extra special tokens, which gives the same ids as
``apply_chat_template(tokenize=True)``. Without it, a string prompt is encoded as raw text with the
tokenizer's special tokens (BOS where it has one); a message list is then an error. Prompts longer
than ``max_prompt_length`` tokens are dropped and counted (a warning names the count; all rows
dropped is an error). Errors are :class:`~rltrain.data.prompt_rows.DataRowError` naming the file,
line or row.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rltrain.data.prompt_rows import DataRowError, PromptExample, PromptFields, parse_row, read_prompt_file

logger = logging.getLogger(__name__)


def render_prompt(
    example: PromptExample, tokenizer: Any, *, apply_chat_template: bool, tools: list[dict] | None = None
) -> str:
    """The prompt text the model sees (see the module docstring for the rules); ``tools`` (function
    schemas of a multi-turn run) go to the chat template."""
    if not apply_chat_template:
        if not isinstance(example.prompt, str):
            raise DataRowError(
                f"{example.origin}: prompt is a chat message list but apply_chat_template is off"
            )
        return example.prompt
    messages = example.prompt
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)


def tokenize_prompts(
    examples: Sequence[PromptExample],
    tokenizer: Any,
    *,
    max_prompt_length: int,
    apply_chat_template: bool = True,
    tools: list[dict] | None = None,
) -> tuple[list[PromptExample], list[int]]:
    """Fill ``prompt_text``/``prompt_ids``; return the examples that fit and the token counts of
    those dropped."""
    texts = [
        render_prompt(ex, tokenizer, apply_chat_template=apply_chat_template, tools=tools) for ex in examples
    ]
    encoded = tokenizer(texts, add_special_tokens=not apply_chat_template)["input_ids"]
    kept, dropped = [], []
    for example, text, ids in zip(examples, texts, encoded):
        if len(ids) <= max_prompt_length:
            example.prompt_text, example.prompt_ids = text, list(ids)
            kept.append(example)
        else:
            dropped.append(len(ids))
    return kept, dropped


class PromptDataset(Sequence[PromptExample]):
    """Tokenized prompts of one split, over-long ones removed and counted in ``num_filtered``."""

    def __init__(self, examples: list[PromptExample], *, num_filtered: int, name: str) -> None:
        self.examples = examples
        self.num_filtered = num_filtered
        self.name = name

    @classmethod
    def load(
        cls,
        paths: str | Path | Sequence[str | Path],
        tokenizer: Any,
        *,
        max_prompt_length: int,
        apply_chat_template: bool = True,
        fields: PromptFields = PromptFields(),
        tools: list[dict] | None = None,
    ) -> PromptDataset:
        """Read, tokenize and filter the rows of ``paths`` (one file or several, concatenated)."""
        path_list = [paths] if isinstance(paths, str | Path) else list(paths)
        rows: list[PromptExample] = []
        for path in path_list:
            rows += read_prompt_file(path, fields=fields, start_index=len(rows))
        return cls.from_examples(
            rows,
            tokenizer,
            name=",".join(str(p) for p in path_list),
            max_prompt_length=max_prompt_length,
            apply_chat_template=apply_chat_template,
            tools=tools,
        )

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[dict[str, Any]],
        tokenizer: Any,
        *,
        name: str,
        max_prompt_length: int,
        apply_chat_template: bool = True,
        fields: PromptFields = PromptFields(),
        tools: list[dict] | None = None,
    ) -> PromptDataset:
        """Build from in-memory rows (a generated task); errors name ``name: row N``."""
        examples = [
            parse_row(row, origin=f"{name}: row {i}", index=i, fields=fields) for i, row in enumerate(rows)
        ]
        return cls.from_examples(
            examples,
            tokenizer,
            name=name,
            max_prompt_length=max_prompt_length,
            apply_chat_template=apply_chat_template,
            tools=tools,
        )

    @classmethod
    def from_examples(
        cls,
        rows: list[PromptExample],
        tokenizer: Any,
        *,
        name: str,
        max_prompt_length: int,
        apply_chat_template: bool = True,
        tools: list[dict] | None = None,
    ) -> PromptDataset:
        """Tokenize parsed rows and drop (and count) the over-long ones; ``tools`` (a multi-turn
        run's function schemas) go to the chat template."""
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be > 0, got {max_prompt_length}")
        if not rows:
            raise DataRowError(f"{name}: no prompts")
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise DataRowError(
                f"{name}: the tokenizer has no chat template; set data.apply_chat_template=false for raw text"
            )
        kept, dropped = tokenize_prompts(
            rows,
            tokenizer,
            max_prompt_length=max_prompt_length,
            apply_chat_template=apply_chat_template,
            tools=tools,
        )
        num_filtered = len(dropped)
        if not kept:
            raise DataRowError(
                f"{name}: all {len(rows)} prompts exceed data.max_prompt_length={max_prompt_length} tokens "
                f"(the shortest has {min(dropped)}{', chat template included' if apply_chat_template else ''})"
            )
        if num_filtered:
            logger.warning(
                "%s: filtered %d of %d prompts longer than max_prompt_length=%d tokens",
                name,
                num_filtered,
                len(rows),
                max_prompt_length,
            )
        return cls(kept, num_filtered=num_filtered, name=name)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> PromptExample:  # type: ignore[override]
        return self.examples[i]
