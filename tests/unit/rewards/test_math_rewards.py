"""GSM8K and arithmetic answer extraction and scoring on hand-written responses."""

from __future__ import annotations

import pytest

from rltrain.rewards import get_reward_fn
from rltrain.rewards.format import GSM8K_ANSWER_PATTERN, THINK_ANSWER_PATTERN, format_reward
from rltrain.rewards.math_answers import (
    arithmetic_reward,
    extract_gsm8k_answer,
    extract_integer_answer,
    gsm8k_reward,
)

NATALIA = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize(
    ("response", "method", "expected"),
    [
        (NATALIA, "strict", "72"),
        ("first #### 3 then corrected #### 5", "strict", "5"),
        ("#### 1,000", "strict", "1000"),
        ("####  $-5", "strict", "-5"),
        ("####\n12.50", "strict", "12.50"),
        ("The answer is 72.", "strict", None),
        ("The answer is 72.", "flexible", "72"),
        ("From 3 apples we get 1,250 pies, so 7.", "flexible", "7"),
        ("no digits at all", "flexible", None),
        ("#### 5" + " filler" * 60, "strict", None),  # the marker lies outside the last 300 chars
    ],
)
def test_extract_gsm8k_answer(response: str, method: str, expected: str | None) -> None:
    assert extract_gsm8k_answer(response, method=method) == expected


def test_gsm8k_scores_correct_wrong_and_missing() -> None:
    right = gsm8k_reward(NATALIA, "72")
    assert (right.score, right.correct, right.answer) == (1.0, True, "72")
    wrong = gsm8k_reward("#### 71", "72", format_score=0.1)
    assert (wrong.score, wrong.correct, wrong.answer) == (0.1, False, "71")
    missing = gsm8k_reward("seventy-two", "72", format_score=0.1)
    assert (missing.score, missing.correct, missing.answer) == (0.0, False, None)
    assert gsm8k_reward("#### 72", "72", correct_score=2.0).score == 2.0


def test_gsm8k_compares_by_value_and_accepts_raw_solution_as_truth() -> None:
    assert gsm8k_reward("#### 42.0", "42").correct
    assert gsm8k_reward("#### 1,000", "1000").correct
    assert gsm8k_reward(
        "so it is 18", "Janet sells 16 - 3 - 4 = 9 eggs... #### 18", method="flexible"
    ).correct
    assert not gsm8k_reward("#### 0.5", "5").correct


def test_openai_gsm8k_alias_and_unknown_method() -> None:
    assert get_reward_fn("openai/gsm8k") is gsm8k_reward
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        gsm8k_reward("#### 1", "1", method="lenient")


@pytest.mark.parametrize(
    ("response", "method", "expected"),
    [
        (" 28\n", "strict", "28"),
        ("28.", "strict", "28"),
        ("-3", "strict", "-3"),
        ("The answer is 28", "strict", None),
        ("2 8", "strict", None),
        ("The answer is 28", "flexible", "28"),
        ("23 + 5 = 28", "flexible", "28"),
        ("none", "flexible", None),
    ],
)
def test_extract_integer_answer(response: str, method: str, expected: str | None) -> None:
    assert extract_integer_answer(response, method=method) == expected


def test_arithmetic_reward_exact_integer() -> None:
    assert arithmetic_reward("28", "28").score == 1.0
    assert arithmetic_reward("-6", "-6").correct
    assert arithmetic_reward("028", "28").correct  # same integer
    wrong = arithmetic_reward("27", "28", format_score=0.2)
    assert (wrong.score, wrong.correct, wrong.answer) == (0.2, False, "27")
    assert arithmetic_reward("It is 28", "28").score == 0.0
    assert arithmetic_reward("It is 28", "28", method="flexible").score == 1.0
    with pytest.raises(ValueError, match=r"ground truth must be an integer, got '2\.5'"):
        arithmetic_reward("2", "2.5")


def test_format_reward_patterns() -> None:
    assert format_reward("<think>add them</think>\n<answer>28</answer>\n", THINK_ANSWER_PATTERN) == 1.0
    assert format_reward("<think>add them</think> 28", THINK_ANSWER_PATTERN) == 0.0
    assert format_reward("lines\nof work\n#### 1,234", GSM8K_ANSWER_PATTERN) == 1.0
    assert format_reward("#### 12 and more text", GSM8K_ANSWER_PATTERN) == 0.0
    with pytest.raises(ValueError, match="not a valid regular expression"):
        format_reward("x", "(unclosed")
