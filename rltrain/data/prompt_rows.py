"""Prompt rows: their layouts, how a row becomes a :class:`PromptExample`, reading them from files.

Files: ``.jsonl`` (one JSON object per line, blank lines skipped), ``.json`` (a JSON array of
rows, or JSON Lines), ``.parquet``. Rows may also come from memory
(:meth:`rltrain.data.dataset.PromptDataset.from_rows`, for generated tasks). Row layouts (both may
appear in one file):

* verl's layout (what ``examples/data_preprocess/gsm8k.py`` writes)::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0}}

* a flat layout: ``{"prompt": "...", "answer": "72", "data_source": "gsm8k"}``, the ground
  truth under ``answer`` or ``ground_truth``.

The prompt (key ``prompt_key``) is a string or a list of chat messages ``{"role", "content"}``.
The ground truth is looked up at ``answer_key`` (a dotted path) or, by default, at
``reward_model.ground_truth``, then ``ground_truth``, then ``answer``; integers are turned into
strings. ``data_source`` comes from the row or ``default_data_source``; ``extra_info`` is an
optional object, kept as is.

Errors name the place: ``data/train.jsonl:17: missing key 'prompt'`` (JSONL lines count from
1), ``data/train.parquet: row 16: ...`` (Parquet, JSON-array and in-memory rows count from 0, as
pandas shows them). A byte that is not UTF-8 names its line. Every such error is a
:class:`DataRowError`, a :class:`~rltrain.config.ConfigError`: the command line prints it in one
line, without a traceback, before any worker starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rltrain.config.recipe import ConfigError

ANSWER_KEYS = ("reward_model.ground_truth", "ground_truth", "answer")
"""Where the ground truth is searched when no ``answer_key`` is set, in order."""


class DataRowError(ConfigError):
    """Unusable prompt data: the message starts with ``file:line``, ``file: row N`` or the file names."""

    def __init__(self, message: str) -> None:
        super().__init__([message])

    def __str__(self) -> str:
        return self.problems[0]


@dataclass(frozen=True)
class PromptFields:
    """Which keys of a row hold what (verl's ``data.prompt_key`` and friends)."""

    prompt_key: str = "prompt"
    """Key of the prompt: a string or a list of ``{"role", "content"}`` messages."""

    answer_key: str | None = None
    """Dotted path of the ground truth (``"reward_model.ground_truth"``); ``None`` tries :data:`ANSWER_KEYS`."""

    data_source_key: str = "data_source"
    """Key naming the reward function of the row."""

    default_data_source: str | None = None
    """data_source of rows without ``data_source_key``; ``None`` makes that key required."""


@dataclass
class PromptExample:
    """One prompt with its reference answer."""

    index: int
    """Position of the row among all rows read, over all files, counted before filtering."""

    prompt: str | list[dict[str, str]]
    """The raw prompt: text, or chat messages ``[{"role": ..., "content": ...}]``."""

    ground_truth: str
    """Reference answer handed to the reward function."""

    data_source: str
    """Selects the reward function (``gsm8k``, ``arithmetic``, ...)."""

    extra_info: dict[str, Any]
    """Free-form metadata of the row (verl's ``extra_info``)."""

    origin: str
    """Where the row came from: ``file:line`` (JSONL) or ``file: row N`` (Parquet)."""

    prompt_text: str = ""
    """The prompt after the chat template, as the rollout engine sees it (set by tokenization)."""

    prompt_ids: list[int] = field(default_factory=list)
    """[prompt_len] token ids of ``prompt_text`` (set by tokenization)."""


def _lookup(row: dict[str, Any], dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _parse_prompt(value: Any, origin: str, key: str) -> str | list[dict[str, str]]:
    if isinstance(value, str):
        if not value.strip():
            raise DataRowError(f"{origin}: empty prompt under key {key!r}")
        return value
    if not isinstance(value, list) or not value:
        raise DataRowError(
            f"{origin}: key {key!r} must be a string or a non-empty list of chat messages, "
            f"got {type(value).__name__}"
        )
    for i, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise DataRowError(
                f"{origin}: {key}[{i}] must be a message with string 'role' and 'content', got {message!r}"
            )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _parse_ground_truth(row: dict[str, Any], origin: str, fields: PromptFields) -> str:
    candidates = (fields.answer_key,) if fields.answer_key else ANSWER_KEYS
    for key in candidates:
        try:
            value = _lookup(row, key)
        except KeyError:
            continue
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise DataRowError(f"{origin}: ground truth {key!r} must be a string or a number, got {value!r}")
        return str(value)
    raise DataRowError(f"{origin}: missing ground truth; looked for keys {list(candidates)}")


def parse_row(row: Any, *, origin: str, index: int, fields: PromptFields) -> PromptExample:
    """Validate one decoded row and turn it into a :class:`PromptExample`."""
    if not isinstance(row, dict):
        raise DataRowError(f"{origin}: a row must be a JSON object, got {type(row).__name__}")
    if fields.prompt_key not in row:
        raise DataRowError(f"{origin}: missing key {fields.prompt_key!r}")
    prompt = _parse_prompt(row[fields.prompt_key], origin, fields.prompt_key)
    data_source = row.get(fields.data_source_key, fields.default_data_source)
    if data_source is None:
        raise DataRowError(f"{origin}: missing key {fields.data_source_key!r} (and no default_data_source)")
    if not isinstance(data_source, str) or not data_source:
        raise DataRowError(
            f"{origin}: {fields.data_source_key!r} must be a non-empty string, got {data_source!r}"
        )
    extra_info = row.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise DataRowError(f"{origin}: 'extra_info' must be an object, got {type(extra_info).__name__}")
    return PromptExample(
        index=index,
        prompt=prompt,
        ground_truth=_parse_ground_truth(row, origin, fields),
        data_source=data_source,
        extra_info=extra_info,
        origin=origin,
    )


def _utf8(data: bytes, path: Path, *, first_line: int | None = None) -> str:
    """``data`` decoded; a byte that is not UTF-8 names its line (``first_line``: ``data`` is one line)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line if first_line is not None else data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise DataRowError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x} at column {column})"
        ) from None


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = _utf8(raw, path, first_line=lineno)
            if not line.strip():
                continue
            origin = f"{path}:{lineno}"
            try:
                yield origin, json.loads(line)
            except json.JSONDecodeError as err:
                raise DataRowError(f"{origin}: invalid JSON: {err}") from None


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """A ``.json`` file holds either one JSON array of rows or JSON Lines."""
    text = _utf8(path.read_bytes(), path)
    if not text.lstrip().startswith("["):
        yield from _jsonl_rows(path)
        return
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataRowError(f"{path}:{err.lineno}: invalid JSON: {err.msg}") from None
    for i, row in enumerate(rows):
        yield f"{path}: row {i}", row


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise DataRowError(f"{path}: not a readable Parquet file ({err})") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}: row {i}", row


def read_prompt_file(
    path: str | Path, *, fields: PromptFields = PromptFields(), start_index: int = 0
) -> list[PromptExample]:
    """Read every row of a ``.jsonl`` or ``.parquet`` file; indices count up from ``start_index``."""
    path = Path(path)
    if not path.is_file():
        raise DataRowError(f"prompt file not found: {path}")
    readers = {".jsonl": _jsonl_rows, ".json": _json_rows, ".parquet": _parquet_rows}
    if path.suffix not in readers:
        raise DataRowError(
            f"{path}: unsupported prompt file type {path.suffix!r}; expected .jsonl, .json or .parquet"
        )
    examples = [
        parse_row(row, origin=origin, index=start_index + i, fields=fields)
        for i, (origin, row) in enumerate(readers[path.suffix](path))
    ]
    if not examples:
        raise DataRowError(f"{path}: no rows")
    return examples
