"""reward.num_workers with reward.custom_reward_function: the function travels to the Ray tasks as its
file's path and scores there exactly as in the driver; its bad answer stops the step with the same
one-line error as in the driver."""

import textwrap

import pytest
import torch

from rltrain.config.reward import CustomRewardFunctionConfig, RewardConfig
from rltrain.orchestrator.reward_workers import RayRewardPool
from rltrain.rewards import RewardError, RewardManager

pytestmark = pytest.mark.e2e

LENGTH_SCORE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, *, scale):
    if solution_str == "bad":
        return "not a score"
    return {"score": scale * len(solution_str), "acc": solution_str == ground_truth}
"""


def test_a_custom_function_scores_in_ray_tasks_like_in_the_driver(local_ray, tmp_path):
    path = tmp_path / "length_score.py"
    path.write_text(textwrap.dedent(LENGTH_SCORE))
    config = RewardConfig(
        custom_reward_function=CustomRewardFunctionConfig(path=str(path), reward_kwargs={"scale": 0.5})
    )
    manager = RewardManager.from_config(config)
    responses, truths = ["a", "bb", "ccc", "dddd", "e"], ["a", "x", "ccc", "x", "x"]
    local = manager(responses, ground_truths=truths, data_sources=["s"] * 5)
    pooled = RayRewardPool(manager, num_workers=2)(responses, ground_truths=truths, data_sources=["s"] * 5)
    assert pooled.scores.tolist() == [0.5, 1.0, 1.5, 2.0, 0.5]
    assert torch.equal(pooled.scores, local.scores) and torch.equal(pooled.correct, local.correct)
    assert pooled.metrics == local.metrics
    with pytest.raises(RewardError) as info:
        RayRewardPool(manager, num_workers=2)(["a", "bad"], ground_truths=["a", "a"], data_sources=["s", "s"])
    assert str(info.value) == (
        f"reward.custom_reward_function.path={str(path)!r}: compute_score(): for data_source 's' the answer "
        "is 'not a score' (str); a reward answers a number, a bool or a dict with a numeric 'score'"
    )
