"""reward.num_workers: scoring in Ray CPU tasks gives exactly the driver's scores and metrics."""

import pytest
import torch

from rltrain.orchestrator.reward_workers import RayRewardPool
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
