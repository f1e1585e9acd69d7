"""What a tool is, what a call to it is, and what it answers.

Contract: a :class:`Tool` has a name, a description and a JSON schema of its arguments object, which
:meth:`Tool.schema` gives in the OpenAI function format that Hugging Face chat templates take as
``tools=``. :meth:`Tool.execute` never raises for anything the model did: a bad expression, a
program that crashes, hangs or floods its output all come back as a :class:`ToolResult` whose
``text`` says what went wrong (``error: ...``) and whose ``error_kind`` names it for the metrics.
The text the model sees holds at most ``max_output_chars`` characters of the tool's output, plus at
most :data:`NOTE_CHARS` characters of notes and error lines the tool adds (see :func:`cut_output`).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

ERROR_KINDS = (
    "parse_error",
    "unknown_tool",
    "bad_arguments",
    "timeout",
    "crash",
    "output_limit",
    "memory",
    "forbidden",
    "too_many_calls",
)
"""The values of :attr:`ToolResult.error_kind` other than ``None``."""

NOTE_CHARS = 200
"""Room a tool's own notes and error lines may take in a result beyond ``max_output_chars``."""


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model wrote."""

    name: str
    """The tool's name."""

    arguments: dict[str, Any]
    """The arguments object, parsed from JSON."""

    raw: str
    """The text of the call as the model wrote it (``<tool_call>...</tool_call>`` for hermes)."""


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn split into its text and its tool calls."""

    content: str
    """The assistant text with the tool-call blocks removed, stripped."""

    calls: list[ToolCall]
    """The well-formed calls, in the order written."""

    errors: list[str]
    """One message per malformed call, written for the model (the loop answers each with a tool
    message of kind ``parse_error``)."""


@dataclass
class ToolResult:
    """What one tool call answered."""

    text: str
    """What the model sees: the output, cut to the limit (saying so), and an ``error: ...`` line on failure."""

    ok: bool
    """Whether the call succeeded."""

    error_kind: str | None
    """``None`` when ok, else one of :data:`ERROR_KINDS`."""

    seconds: float
    """Wall-clock of the call."""

    def __post_init__(self) -> None:
        if self.ok != (self.error_kind is None):
            raise ValueError(
                f"a ToolResult is ok exactly when error_kind is None (ok={self.ok}, error_kind={self.error_kind!r})"
            )
        if self.error_kind is not None and self.error_kind not in ERROR_KINDS:
            raise ValueError(f"unknown error_kind {self.error_kind!r}; known: {', '.join(ERROR_KINDS)}")

    @classmethod
    def failure(cls, kind: str, text: str, *, seconds: float = 0.0) -> ToolResult:
        """A failed call of ``kind`` whose text is ``text`` (the caller writes the ``error:`` line)."""
        return cls(text=text, ok=False, error_kind=kind, seconds=seconds)


def cut_output(text: str, max_chars: int) -> tuple[str, bool]:
    """``text`` cut to ``max_chars`` characters with a note saying so, and whether it was cut."""
    if len(text) <= max_chars:
        return text, False
    return text[:max_chars] + f"\n[output cut at {max_chars} characters]", True


class Tool(ABC):
    """A tool the model may call. Subclasses set the three class attributes and implement
    :meth:`execute`; a tool config may override the attributes per instance."""

    name: str
    """The name the model calls the tool by."""

    description: str
    """What the tool does, for the model."""

    parameters: dict[str, Any]
    """JSON schema of the arguments object (``{"type": "object", "properties": ..., "required": ...}``)."""

    def schema(self) -> dict[str, Any]:
        """The tool in the OpenAI function format (what chat templates take as ``tools=``)."""
        parameters = copy.deepcopy(self.parameters)  # the caller may edit it; the class's stays as it is
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": parameters},
        }

    @abstractmethod
    async def execute(
        self, arguments: dict[str, Any], *, timeout_s: float, max_output_chars: int
    ) -> ToolResult:
        """Run one call whose ``arguments`` already passed :attr:`parameters`; finish within
        ``timeout_s`` seconds and keep the output to ``max_output_chars`` characters (plus notes)."""
