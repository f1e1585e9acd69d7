"""Tool-call parsers: an assistant turn's text -> its content, its calls and its malformed calls.

``hermes`` (Hermes, Qwen2.5/3) writes each call as ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``, any number per turn, with any whitespace around the JSON. ``arguments`` may also
be a JSON string holding an object (Qwen sometimes writes that), and may be left out for a tool
without arguments. A malformed call (not JSON, no ``name``, arguments not an object, a
``<tool_call>`` never closed) is not raised: it becomes a message for the model in
:attr:`ParsedTurn.errors`, and its text is removed from the content like a good call's. A
``</tool_call>`` with no opening tag is ordinary text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .base import ParsedTurn, ToolCall

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"


def parse_hermes(text: str) -> ParsedTurn:
    """Split an assistant turn written in the hermes format."""
    pieces: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos, number = 0, 0
    while (start := text.find(HERMES_OPEN, pos)) != -1:
        pieces.append(text[pos:start])
        number += 1
        body_start = start + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, body_start)
        if end == -1:
            errors.append(f"tool call {number} has no closing {HERMES_CLOSE} tag")
            pos = len(text)
            break
        pos = end + len(HERMES_CLOSE)
        call_or_error = _hermes_call(text[body_start:end], raw=text[start:pos], number=number)
        if isinstance(call_or_error, ToolCall):
            calls.append(call_or_error)
        else:
            errors.append(call_or_error)
    pieces.append(text[pos:])
    return ParsedTurn(content="".join(pieces).strip(), calls=calls, errors=errors)


def _hermes_call(body: str, *, raw: str, number: int) -> ToolCall | str:
    """The call one block holds, or the message saying what is wrong with it."""
    where = f"tool call {number}"
    obj = _decode(body)
    if isinstance(obj, json.JSONDecodeError):
        return f"{where} is not valid JSON ({obj.msg} at line {obj.lineno} column {obj.colno})"
    if not isinstance(obj, dict):
        return f'{where} must be a JSON object {{"name": ..., "arguments": {{...}}}}, got {_json_type(obj)}'
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f'{where} has no "name" (a non-empty string naming the tool)'
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        arguments = _decode(arguments)
        if isinstance(arguments, json.JSONDecodeError):
            return f'{where} ({name}): "arguments" is a string that is not valid JSON ({arguments.msg})'
    if not isinstance(arguments, dict):
        return f'{where} ({name}): "arguments" must be a JSON object, got {_json_type(arguments)}'
    return ToolCall(name=name, arguments=arguments, raw=raw)


def _decode(text: str) -> Any:
    """The JSON value ``text`` holds, or the error saying why it holds none."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return e


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


_PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes}


def get_parser(format: str) -> Callable[[str], ParsedTurn]:
    """The parser of a tool-call format (``rollout.multi_turn.format``)."""
    if format not in _PARSERS:
        raise ValueError(f"unknown tool-call format {format!r}; known: {', '.join(sorted(_PARSERS))}")
    return _PARSERS[format]
