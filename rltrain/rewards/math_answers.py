"""Answer extraction and scoring for math word problems: GSM8K and the generated arithmetic task.

GSM8K (data_source ``gsm8k`` and verl's ``openai/gsm8k``) follows verl's ``gsm8k.compute_score``:

* ``method="strict"`` takes the number after the last ``####`` marker (the GSM8K solution format);
* ``method="flexible"`` takes the last number anywhere in the response;
* only the last 300 characters are searched (the final answer sits at the end; regexes on very
  long responses are slow);
* a correct answer scores ``correct_score``, a wrong but extractable one ``format_score``, no
  answer 0.

Departures from verl, on purpose: numbers are compared by value after removing thousands
separators and ``$`` (``"1,000"`` == ``"1000"``, ``"42.0"`` == ``"42"``) where verl compares
strings; any whitespace may follow ``####`` (verl wants exactly one space); a ground truth holding a
raw GSM8K solution (``"... #### 72"``) is reduced to its final number.

Arithmetic (data_source ``arithmetic``) wants an exact integer: ``method="strict"`` accepts a
response that is only the integer (surrounding whitespace and one trailing period allowed),
``method="flexible"`` takes the last integer anywhere in the response.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from rltrain.rewards.registry import RewardResult, register_reward

SOLUTION_CLIP_CHARS = 300
"""Only this many trailing characters of a response are searched for the GSM8K answer."""

_NUMBER = r"-?[\d,]*\.?\d+"
_GSM8K_STRICT = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)
_INTEGER_ONLY = re.compile(r"\s*(-?\d+)\.?\s*")
_ANY_INTEGER = re.compile(r"-?\d+")


def normalize_number(text: str) -> str:
    """Drop thousands separators, ``$`` and a leading ``+``; ``"$1,000"`` -> ``"1000"``."""
    return text.replace(",", "").replace("$", "").strip().lstrip("+")


def extract_gsm8k_answer(response: str, *, method: str = "strict") -> str | None:
    """The final answer of a GSM8K-style response, normalized, or ``None`` if there is none."""
    tail = response[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        matches = _GSM8K_STRICT.findall(tail)
    elif method == "flexible":
        matches = _ANY_NUMBER.findall(tail)
    else:
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    for candidate in reversed(matches):
        answer = normalize_number(candidate)
        if answer not in ("", "-"):
            return answer
    return None


def numbers_equal(a: str, b: str) -> bool:
    """Compare two normalized numbers by value; fall back to string equality if one is not a number."""
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b


def gsm8k_ground_truth(ground_truth: str) -> str:
    """The reference number: the text after ``####`` for a raw GSM8K solution, else the whole string."""
    if "####" in ground_truth:
        ground_truth = ground_truth.rsplit("####", 1)[1]
    return normalize_number(ground_truth)


def gsm8k_ground_truth_problem(ground_truth: str) -> str | None:
    """Why ``ground_truth`` cannot be a GSM8K reference (it must reduce to a finite number)."""
    try:
        if Decimal(gsm8k_ground_truth(ground_truth)).is_finite():
            return None
    except InvalidOperation:
        pass
    return "is not a number"


@register_reward("gsm8k", "openai/gsm8k", ground_truth=gsm8k_ground_truth_problem)
def gsm8k_reward(
    response: str,
    ground_truth: str,
    *,
    method: str = "strict",
    correct_score: float = 1.0,
    format_score: float = 0.0,
) -> RewardResult:
    """Score a GSM8K response: ``correct_score`` if right, ``format_score`` if wrong, 0 if no answer."""
    answer = extract_gsm8k_answer(response, method=method)
    if answer is None:
        return RewardResult(score=0.0, correct=False, answer=None)
    correct = numbers_equal(answer, gsm8k_ground_truth(ground_truth))
    return RewardResult(score=correct_score if correct else format_score, correct=correct, answer=answer)


def extract_integer_answer(response: str, *, method: str = "strict") -> str | None:
    """The integer answer of an arithmetic response, or ``None``."""
    if method == "strict":
        match = _INTEGER_ONLY.fullmatch(response)
        return match.group(1) if match else None
    if method == "flexible":
        matches = _ANY_INTEGER.findall(response)
        return matches[-1] if matches else None
    raise ValueError(f"arithmetic method must be 'strict' or 'flexible', got {method!r}")


def integer_ground_truth_problem(ground_truth: str) -> str | None:
    """Why ``ground_truth`` cannot be an arithmetic reference (it must be an integer)."""
    return None if _ANY_INTEGER.fullmatch(ground_truth.strip()) else "is not an integer"


@register_reward("arithmetic", ground_truth=integer_ground_truth_problem)
def arithmetic_reward(
    response: str,
    ground_truth: str,
    *,
    method: str = "strict",
    correct_score: float = 1.0,
    format_score: float = 0.0,
) -> RewardResult:
    """Exact integer match: ``correct_score`` if equal, ``format_score`` if another integer, else 0."""
    answer = extract_integer_answer(response, method=method)
    if answer is None:
        return RewardResult(score=0.0, correct=False, answer=None)
    if integer_ground_truth_problem(ground_truth):
        raise ValueError(f"arithmetic ground truth must be an integer, got {ground_truth!r}")
    correct = int(answer) == int(ground_truth.strip())
    return RewardResult(score=correct_score if correct else format_score, correct=correct, answer=answer)
