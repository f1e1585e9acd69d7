"""Rows the rewards cannot score fail when the data loads: an unknown data_source (naming the row's
file:line and the registered sources), a ground truth of the wrong kind for its reward function."""

from __future__ import annotations

import pytest

from rltrain.config import ConfigError
from rltrain.data.prompt_rows import DataRowError, PromptExample
from rltrain.rewards import RewardManager, registered_data_sources
from rltrain.rewards.math_answers import gsm8k_ground_truth_problem, integer_ground_truth_problem


def example(data_source: str, ground_truth: str, line: int) -> PromptExample:
    return PromptExample(
        index=line - 1,
        prompt="p",
        ground_truth=ground_truth,
        data_source=data_source,
        extra_info={},
        origin=f"data/train.jsonl:{line}",
    )


def error_of(manager: RewardManager, examples: list[PromptExample]) -> str:
    with pytest.raises(DataRowError) as err:
        manager.check_examples(examples)
    assert isinstance(err.value, ConfigError)
    return str(err.value)


def test_unknown_data_source_names_the_row_and_the_registered_ones() -> None:
    rows = [example("gsm8k", "72", 1), example("gsm9k", "1", 2), example("mystery", "1", 3)]
    assert error_of(RewardManager(), rows) == (
        f"data/train.jsonl:2: no reward function registered for data_source 'gsm9k'; registered: "
        f"{registered_data_sources()}; map other names with reward.source_overrides "
        "(1 more rows have a problem)"
    )
    RewardManager(source_overrides={"gsm9k": "gsm8k", "mystery": "arithmetic"}).check_examples(rows)


def test_ground_truth_of_the_wrong_kind_names_the_row_and_the_reward() -> None:
    assert error_of(RewardManager(), [example("openai/gsm8k", "seventy-two", 4)]) == (
        "data/train.jsonl:4: ground truth 'seventy-two' is not a number, which the 'openai/gsm8k' "
        "reward of data_source 'openai/gsm8k' needs"
    )
    assert error_of(
        RewardManager(source_overrides={"arith": "arithmetic"}), [example("arith", "2.5", 7)]
    ) == (
        "data/train.jsonl:7: ground truth '2.5' is not an integer, which the 'arithmetic' reward of "
        "data_source 'arith' needs"
    )


def test_ground_truth_checks_accept_what_the_rewards_score() -> None:
    for good in ("72", "1,000", "$5", "-3.5", "Natalia sold ... #### 72"):
        assert gsm8k_ground_truth_problem(good) is None, good
    for bad in ("", "seventy", "NaN", "Infinity", "#### x"):
        assert gsm8k_ground_truth_problem(bad) == "is not a number", bad
    assert [integer_ground_truth_problem(g) for g in ("19", " -4 ", "4.0", "x")] == [
        None,
        None,
        "is not an integer",
        "is not an integer",
    ]
