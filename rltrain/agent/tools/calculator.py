"""The ``calculator`` tool: arithmetic on numbers, evaluated from the syntax tree (never ``eval``).

Allowed: int and float literals, ``+ - * / // % **``, unary ``+``/``-`` and parentheses. Anything
else (names, calls, attribute access, strings, comparisons, ...) is refused with a message naming
it. Sizes are bounded so that no expression can take long: the expression holds at most
:data:`MAX_EXPRESSION_CHARS` characters, and every literal, intermediate value and result at most
:data:`MAX_MAGNITUDE` in absolute value (a power is refused before it is computed when its result
would exceed that; a float that overflows to infinity exceeds it too). Division by zero and a
non-real result are errors too; every error has ``error_kind="bad_arguments"``.

The result text is the number: an int as an int (``"8798"``), a float as its shortest repr with a
trailing ``.0`` dropped (``"3.5"``, ``"2"`` for ``4/2``).
"""

from __future__ import annotations

import ast
import math
import operator
import time
from collections.abc import Callable
from typing import Any

from .base import Tool, ToolResult, cut_output

MAX_EXPRESSION_CHARS = 1000
MAX_MAGNITUDE = 10**100

_BINARY: dict[type[ast.operator], tuple[str, Callable[[Any, Any], Any]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
    ast.FloorDiv: ("//", operator.floordiv),
    ast.Mod: ("%", operator.mod),
    ast.Pow: ("**", operator.pow),
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_REFUSED: dict[type[ast.AST], str] = {
    ast.Name: "names are",
    ast.Call: "function calls are",
    ast.Attribute: "attribute access is",
    ast.Subscript: "subscripts are",
    ast.Compare: "comparisons are",
    ast.BoolOp: "boolean operators are",
    ast.Lambda: "lambdas are",
    ast.JoinedStr: "f-strings are",
}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is for the model."""


class CalculatorTool(Tool):
    """Evaluates an arithmetic expression."""

    name = "calculator"
    description = (
        "Evaluate an arithmetic expression with numbers, + - * / // % ** and parentheses; returns the number."
    )
    parameters = {  # noqa: RUF012  (read-only: a tool config overrides it per instance, never mutates it)
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "The expression, e.g. 4821 + 3977."}},
        "required": ["expression"],
    }

    async def execute(
        self, arguments: dict[str, Any], *, timeout_s: float, max_output_chars: int
    ) -> ToolResult:
        start = time.monotonic()
        try:
            text = format_number(evaluate(arguments["expression"]))
        except CalculatorError as e:
            return ToolResult.failure("bad_arguments", f"error: {e}", seconds=time.monotonic() - start)
        text, _ = cut_output(text, max_output_chars)
        return ToolResult(text=text, ok=True, error_kind=None, seconds=time.monotonic() - start)


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; :class:`CalculatorError` saying why when there is none."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise CalculatorError(f"not a valid expression: {getattr(e, 'msg', None) or e}") from None
    try:
        return _value(tree.body)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None


def format_number(value: int | float) -> str:
    """An int as an int; a float as its shortest repr without a trailing ``.0``."""
    if isinstance(value, int):
        return str(value)
    text = repr(value)
    return text[:-2] if text.endswith(".0") else text


def _value(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"only numbers are allowed, found {node.value!r}")
        return _bounded(node.value, "a number")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        symbol, op = _BINARY[type(node.op)]
        left, right = _value(node.left), _value(node.right)
        if symbol == "**":
            _check_power(left, right)
        try:
            result = op(left, right)
        except ZeroDivisionError:
            raise CalculatorError(f"division by zero in {symbol}") from None
        if isinstance(result, complex):
            raise CalculatorError(f"the result of {symbol} is not a real number")
        return _bounded(result, f"the result of {symbol}")
    what = _REFUSED.get(type(node), f"{type(node).__name__} expressions are")
    raise CalculatorError(f"{what} not allowed: use numbers, + - * / // % ** and parentheses")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power whose result would exceed MAX_MAGNITUDE, before computing it."""
    if base == 0:  # 0 ** -1 is a division by zero, left to the operator
        return
    if exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise CalculatorError(f"the result of ** is larger than 10**{round(math.log10(MAX_MAGNITUDE))}")


def _bounded(value: int | float, what: str) -> int | float:
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"{what} is larger than 10**{round(math.log10(MAX_MAGNITUDE))}")
    return value
