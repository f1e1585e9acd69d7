"""Batch scoring by data_source: scores, correctness and metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rltrain.rewards import RewardManager, UnknownDataSourceError, register_reward, registered_data_sources
from rltrain.rewards.format import THINK_ANSWER_PATTERN
from rltrain.rewards.math_answers import arithmetic_reward
from rltrain.rewards.registry import RewardResult


def test_mixed_batch_scores_and_metrics() -> None:
    manager = RewardManager(format_score=0.1, reward_kwargs={"arithmetic": {"method": "flexible"}})
    out = manager(
        ["work #### 72", "#### 70", "it is 27", "so 5"],
        ground_truths=["72", "72", "28", "5"],
        data_sources=["gsm8k", "openai/gsm8k", "arithmetic", "arithmetic"],
    )
    # right, wrong (format credit 0.1), wrong (0.1, flexible extraction), right
    expected = [1.0, 0.1, 0.1, 1.0]
    assert out.scores.dtype == torch.float32
    assert out.scores.tolist() == pytest.approx(expected)
    assert out.correct.tolist() == [True, False, False, True]
    assert [r.answer for r in out.results] == ["72", "70", "27", "5"]
    m = out.metrics
    assert m["reward/score/mean"] == pytest.approx(0.55)
    assert m["reward/score/std"] == pytest.approx(0.45)  # population std: every score is 0.45 from 0.55
    assert (m["reward/score/min"], m["reward/score/max"]) == (0.1, 1.0)
    assert m["reward/accuracy"] == pytest.approx(0.5)
    assert m["reward/answered"] == pytest.approx(1.0)
    assert m["reward/by_source/arithmetic/score_mean"] == pytest.approx(0.55)
    assert m["reward/by_source/arithmetic/count"] == 2.0
    assert m["reward/by_source/gsm8k/accuracy"] == 1.0
    assert m["reward/by_source/openai/gsm8k/score_mean"] == pytest.approx(0.1)
    assert "reward/format/mean" not in m


def test_correct_score_and_source_overrides() -> None:
    manager = RewardManager(correct_score=2.0, source_overrides={"my_math": "gsm8k"})
    out = manager(["#### 3", "3"], ground_truths=["3", "3"], data_sources=["my_math", "arithmetic"])
    assert out.scores.tolist() == [2.0, 2.0]
    assert out.metrics["reward/by_source/my_math/accuracy"] == 1.0
    with pytest.raises(UnknownDataSourceError, match="'gsmk8'"):
        RewardManager(source_overrides={"my_math": "gsmk8"})


def test_from_config() -> None:
    from rltrain.config.reward import RewardConfig

    manager = RewardManager.from_config(
        RewardConfig(correct_score=1.0, format_score=0.25, source_overrides={"x": "arithmetic"})
    )
    assert manager(["4"], ground_truths=["5"], data_sources=["x"]).scores.tolist() == [0.25]


def test_format_bonus_is_added() -> None:
    manager = RewardManager(format_pattern=THINK_ANSWER_PATTERN, format_coef=0.5)
    out = manager(
        ["<think>3+4</think><answer>7</answer>", "7", "<think>x</think><answer>8</answer>"],
        ground_truths=["7", "7", "7"],
        data_sources=["arithmetic"] * 3,
    )
    # The think/answer layout is not a bare integer, so strict arithmetic gives it 0.
    assert out.scores.tolist() == [0.5, 1.0, 0.5]
    assert out.metrics["reward/format/mean"] == pytest.approx(2 / 3)
    assert out.metrics["reward/score/std"] == pytest.approx(
        math.sqrt(((0.5 - 2 / 3) ** 2 * 2 + (1 / 3) ** 2) / 3)
    )


def test_unknown_data_source_lists_registered() -> None:
    with pytest.raises(UnknownDataSourceError) as err:
        RewardManager()(["1"], ground_truths=["1"], data_sources=["mystery"])
    assert str(err.value) == (
        f"no reward function registered for data_source 'mystery'; registered: {registered_data_sources()}; "
        "map other names with reward.source_overrides"
    )
    assert {"arithmetic", "gsm8k", "openai/gsm8k"} <= set(registered_data_sources())


def test_bad_settings_fail_at_construction() -> None:
    with pytest.raises(
        ValueError,
        match=r"'gsm8k': unknown \['methd'\]; accepted: \['correct_score', 'format_score', 'method'\]",
    ):
        RewardManager(reward_kwargs={"gsm8k": {"methd": "flexible"}})
    with pytest.raises(UnknownDataSourceError, match="'gsmk8'"):
        RewardManager(reward_kwargs={"gsmk8": {}})
    with pytest.raises(ValueError, match="needs a format_pattern"):
        RewardManager(format_coef=0.1)
    with pytest.raises(ValueError, match="3 responses, 2 ground truths"):
        RewardManager()(["1", "2", "3"], ground_truths=["1", "2"], data_sources=["arithmetic"] * 3)


def test_custom_registration_and_duplicate_refused() -> None:
    @register_reward("test/length_is_truth")
    def length_reward(
        response: str, ground_truth: str, *, correct_score: float, format_score: float
    ) -> RewardResult:
        ok = len(response) == int(ground_truth)
        return RewardResult(
            score=correct_score if ok else format_score, correct=ok, answer=str(len(response))
        )

    out = RewardManager()(["abc", "ab"], ground_truths=["3", "3"], data_sources=["test/length_is_truth"] * 2)
    assert out.scores.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="already has a reward function"):
        register_reward("test/length_is_truth")(arithmetic_reward)
    with pytest.raises(TypeError, match=r"must take keyword-only \['correct_score', 'format_score'\]"):
        register_reward("test/no_kwargs")(lambda response, ground_truth: None)


def test_format_keys_of_the_config_reach_the_manager() -> None:
    from rltrain.config.reward import RewardConfig

    manager = RewardManager.from_config(RewardConfig(format_pattern=THINK_ANSWER_PATTERN, format_coef=0.25))
    out = manager(
        ["<think>2+2</think>\n<answer>4</answer>", "4", "<answer>4</answer>"],
        ground_truths=["4"] * 3,
        data_sources=["arithmetic"] * 3,
    )
    # strict arithmetic: only the bare "4" is an answer; only the first has the think/answer layout
    assert out.scores.tolist() == [0.25, 1.0, 0.0]
    assert out.metrics["reward/format/mean"] == pytest.approx(1 / 3)
    watched = RewardManager.from_config(RewardConfig(format_pattern=r"\d+"))  # coef 0: the rate alone
    out = watched(["4", "four"], ground_truths=["4", "4"], data_sources=["arithmetic"] * 2)
    assert out.scores.tolist() == [1.0, 0.0]
    assert out.metrics["reward/format/mean"] == 0.5
