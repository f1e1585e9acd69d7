"""Hermes tool-call parsing: exact content, calls and error messages for well-formed and malformed turns."""

from __future__ import annotations

import pytest

from rltrain.agent.tools import ParsedTurn, ToolCall, get_parser, parse_hermes

CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'


def test_single_call_and_text_around_it() -> None:
    text = f"Let me add.\n{CALC}\nDone?"
    assert parse_hermes(text) == ParsedTurn(
        content="Let me add.\n\nDone?",
        calls=[ToolCall(name="calculator", arguments={"expression": "2+2"}, raw=CALC)],
        errors=[],
    )


def test_several_calls_in_order_with_whitespace_around_the_json() -> None:
    second = '<tool_call>   {"name": "python", "arguments": {"code": "print(1)"}}\t\n\n</tool_call>'
    parsed = parse_hermes(f"{CALC}{second}  ")
    assert parsed == ParsedTurn(
        content="",
        calls=[
            ToolCall(name="calculator", arguments={"expression": "2+2"}, raw=CALC),
            ToolCall(name="python", arguments={"code": "print(1)"}, raw=second),
        ],
        errors=[],
    )


def test_arguments_as_a_json_string_and_arguments_left_out() -> None:
    as_string = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"7/2\\"}"}</tool_call>'
    no_arguments = '<tool_call>{"name": "clock"}</tool_call>'
    assert parse_hermes(as_string + no_arguments).calls == [
        ToolCall(name="calculator", arguments={"expression": "7/2"}, raw=as_string),
        ToolCall(name="clock", arguments={}, raw=no_arguments),
    ]


def test_text_without_calls_and_a_stray_closing_tag_are_content() -> None:
    assert parse_hermes("  The answer is 4.</tool_call> \n") == ParsedTurn(
        content="The answer is 4.</tool_call>", calls=[], errors=[]
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"name": "calculator", "arguments": {', "tool call 1 is not valid JSON (Expecting property name enclosed in double quotes at line 1 column 38)"),
        ('{"arguments": {"expression": "1"}}', 'tool call 1 has no "name" (a non-empty string naming the tool)'),
        ('{"name": "", "arguments": {}}', 'tool call 1 has no "name" (a non-empty string naming the tool)'),
        ('{"name": "calculator", "arguments": [1, 2]}', 'tool call 1 (calculator): "arguments" must be a JSON object, got an array'),
        ('{"name": "calculator", "arguments": "[1]"}', 'tool call 1 (calculator): "arguments" must be a JSON object, got an array'),
        ('{"name": "calculator", "arguments": "{oops"}', 'tool call 1 (calculator): "arguments" is a string that is not valid JSON (Expecting property name enclosed in double quotes)'),
        ('["calculator"]', 'tool call 1 must be a JSON object {"name": ..., "arguments": {...}}, got an array'),
    ],
)  # fmt: skip
def test_malformed_call_becomes_an_error_and_leaves_the_content(body: str, message: str) -> None:
    parsed = parse_hermes(f"before <tool_call>{body}</tool_call> after")
    assert parsed == ParsedTurn(content="before  after", calls=[], errors=[message])


def test_good_and_bad_calls_are_numbered_in_the_order_written() -> None:
    bad = "<tool_call>not json</tool_call>"
    parsed = parse_hermes(f"{bad}{CALC}{bad}")
    assert parsed.calls == [ToolCall(name="calculator", arguments={"expression": "2+2"}, raw=CALC)]
    assert parsed.errors == [
        "tool call 1 is not valid JSON (Expecting value at line 1 column 1)",
        "tool call 3 is not valid JSON (Expecting value at line 1 column 1)",
    ]


def test_unclosed_tag_is_an_error_and_its_text_is_dropped() -> None:
    parsed = parse_hermes(f'Sure. {CALC} then <tool_call>{{"name": "calculator", "arguments": {{}}}}')
    assert parsed == ParsedTurn(
        content="Sure.  then",
        calls=[ToolCall(name="calculator", arguments={"expression": "2+2"}, raw=CALC)],
        errors=["tool call 2 has no closing </tool_call> tag"],
    )


def test_get_parser() -> None:
    assert get_parser("hermes") is parse_hermes
    with pytest.raises(ValueError, match=r"^unknown tool-call format 'json'; known: hermes$"):
        get_parser("json")
