"""reward.num_workers: scoring in Ray CPU tasks gives exactly the driver's scores and metrics; tasks
that hang stop the step within trainer.timeouts.reward_s."""

import time

import pytest
import torch

from rltrain.orchestrator.reward_workers import RayRewardPool, RewardTimeout
from rltrain.rewards import RewardManager

pytestmark = pytest.mark.e2e


def test_ray_tasks_score_like_the_driver(local_ray):
    responses = ["12", " 7.", "The answer is 9", "#### 42", "#### 41", "x", "3", "1,000"]
    truths = ["12", "7", "9", "42", "42", "5", "4", "1000"]
    sources = ["arithmetic"] * 3 + ["gsm8k"] * 2 + ["arithmetic"] * 2 + ["gsm8k"]
    manager = RewardManager(correct_score=1.0, format_score=0.1)
    local = manager(responses, ground_truths=truths, data_sources=sources)
    pooled = RayRewardPool(manager, num_workers=3)(responses, ground_truths=truths, data_sources=sources)
    assert torch.equal(pooled.scores, local.scores) and torch.equal(pooled.correct, local.correct)
    assert pooled.metrics == local.metrics
    # hand-checked: strict arithmetic accepts "12" and " 7.", gsm8k wants "#### n" (41 earns format_score)
    assert pooled.scores.tolist() == pytest.approx([1.0, 1.0, 0.0, 1.0, 0.1, 0.0, 0.1, 0.0])


class _HangingRewards(RewardManager):
    """A reward function that never returns (stands for a verifier stuck on some input)."""

    def score_one(self, response: str, ground_truth: str, data_source: str):
        time.sleep(3600)


def test_reward_tasks_that_hang_stop_the_step_in_one_line_within_the_timeout(local_ray):
    import sys

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests
    pool = RayRewardPool(_HangingRewards(), num_workers=2, timeout_s=2.0)
    start = time.monotonic()
    with pytest.raises(RewardTimeout) as info:
        pool(["1", "2", "3"], ground_truths=["1", "2", "3"], data_sources=["arithmetic"] * 3)
    assert 2.0 <= time.monotonic() - start < 4.0
    assert str(info.value) == (
        "reward workers: 2 of 2 chunks of the step's 3 responses not scored within 2 s "
        "(trainer.timeouts.reward_s): a reward function that hangs?"
    )
