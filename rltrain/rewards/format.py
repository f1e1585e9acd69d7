"""Format reward: does a response follow a required layout (a regular expression)?

The manager adds ``format_coef * format_reward(response)`` to the task score of every sequence
when a pattern is configured, independent of the data_source. The pattern must match the whole
stripped response (``re.fullmatch``, ``.`` matches newlines), so anchors are implicit.
"""

from __future__ import annotations

import re

THINK_ANSWER_PATTERN = r"<think>.*?</think>\s*<answer>.*?</answer>"
"""R1-style reasoning layout: a think block followed by an answer block."""

GSM8K_ANSWER_PATTERN = r".*####\s*\$?\s*-?[\d,]*\.?\d+\s*"
"""Any text that ends with a GSM8K final-answer line ``#### <number>``."""


def compile_format_pattern(pattern: str) -> re.Pattern[str]:
    """Compile a format pattern, naming it in the error when it is not a valid regex."""
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as err:
        raise ValueError(f"format pattern {pattern!r} is not a valid regular expression: {err}") from None


def format_reward(response: str, pattern: re.Pattern[str] | str) -> float:
    """1.0 when the stripped response matches ``pattern`` entirely, else 0.0."""
    compiled = compile_format_pattern(pattern) if isinstance(pattern, str) else pattern
    return 1.0 if compiled.fullmatch(response.strip()) else 0.0
