"""The calculator: exact values by hand, and a refusal naming what is not allowed for everything else."""

from __future__ import annotations

import asyncio

import pytest

from rltrain.agent.tools import CalculatorTool, ToolResult


def calc(expression: str, max_output_chars: int = 1000) -> ToolResult:
    tool = CalculatorTool()
    return asyncio.run(
        tool.execute({"expression": expression}, timeout_s=1.0, max_output_chars=max_output_chars)
    )


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("4821+3977", "8798"),
        ("2**10", "1024"),
        ("7/2", "3.5"),
        ("4/2", "2"),
        ("-(3 - 10) * 2", "14"),
        ("17 // 5", "3"),
        ("-17 // 5", "-4"),
        ("17 % 5", "2"),
        ("0.1 + 0.2", "0.30000000000000004"),
        ("2 ** -2", "0.25"),
        ("+5", "5"),
        ("  (1 + 2) * (3 + 4)  ", "21"),
        ("10**100", "1" + "0" * 100),
        ("1.5e3 * 2", "3000"),
    ],
)
def test_values(expression: str, value: str) -> None:
    result = calc(expression)
    assert (result.text, result.ok, result.error_kind) == (value, True, None)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("x + 1", "error: names are not allowed: use numbers, + - * / // % ** and parentheses"),
        ("abs(-1)", "error: function calls are not allowed: use numbers, + - * / // % ** and parentheses"),
        ("(1).real", "error: attribute access is not allowed: use numbers, + - * / // % ** and parentheses"),
        ("__import__('os').system('true')", "error: function calls are not allowed: use numbers, + - * / // % ** and parentheses"),
        ("'a' * 3", "error: only numbers are allowed, found 'a'"),
        ("True + 1", "error: only numbers are allowed, found True"),
        ("1 < 2", "error: comparisons are not allowed: use numbers, + - * / // % ** and parentheses"),
        ("[1, 2]", "error: List expressions are not allowed: use numbers, + - * / // % ** and parentheses"),
        ("1 +", "error: not a valid expression: invalid syntax"),
        ("9**9**9", "error: the result of ** is larger than 10**100"),
        ("0.001 ** -1000000", "error: the result of ** is larger than 10**100"),
        ("2**333", "error: the result of ** is larger than 10**100"),
        ("10**100 * 10", "error: the result of * is larger than 10**100"),
        ("1e101", "error: a number is larger than 10**100"),
        ("1e99 / 1e-300", "error: the result of / is larger than 10**100"),  # inf, from a float overflow
        ("1/0", "error: division by zero in /"),
        ("5 % 0", "error: division by zero in %"),
        ("0 ** -1", "error: division by zero in **"),
        ("(-8) ** 0.5", "error: the result of ** is not a real number"),
        ("1" * 1001, "error: the expression is longer than 1000 characters"),
    ],
)  # fmt: skip
def test_refusals(expression: str, message: str) -> None:
    result = calc(expression)
    assert (result.text, result.ok, result.error_kind) == (message, False, "bad_arguments")


def test_output_is_cut_to_the_limit() -> None:
    assert calc("10**20", max_output_chars=5).text == "10000\n[output cut at 5 characters]"


def test_schema_is_the_openai_function_format() -> None:
    assert CalculatorTool().schema() == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": CalculatorTool.description,
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "The expression, e.g. 4821 + 3977."}
                },
                "required": ["expression"],
            },
        },
    }
