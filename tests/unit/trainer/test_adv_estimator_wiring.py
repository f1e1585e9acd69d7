"""``algorithm.adv_estimator`` set by an override reaches the advantage estimator through the driver's
advantage stage, with the batch's group ids, masks and (remax) greedy baselines: advantages against
values derived by hand."""

import math

import pytest
import torch

from rltrain.config import load_config
from rltrain.data.step_batch import build_step_batch
from rltrain.trainer.driver import PPOTrainer, Roles

# Three prompts × n = 2. Response lengths 3, 1 | 2, 0 | 3, 2 of response_length 4. The empty response's
# score (0.7) sits on no valid token and counts as 0, so the scores the estimators see are
# 1, 0 | 0.5, 0 | 2, 1.
LENGTHS = [3, 1, 2, 0, 3, 2]
SCORES = [1.0, 0.0, 0.5, 0.7, 2.0, 1.0]
GREEDY = [0.5, 1.0, 1.5]  # reward of each prompt's greedy response (remax)


def _advantages(tmp_path, estimator: str) -> torch.Tensor:
    config = load_config(
        "recipes/quickstart_cpu.yaml",
        [
            f"trainer.default_local_dir={tmp_path}",
            f"algorithm.adv_estimator={estimator}",
            "algorithm.use_kl_in_reward=false",
            "rollout.n=2",
            "actor.ppo_micro_batch_size_per_gpu=8",
        ],
    )
    assert not config.critic_enabled()
    trainer = PPOTrainer(
        config, roles=Roles(None, None), tokenizer=None, data=None, rewards=None, tracker=None, total_steps=1
    )
    batch = build_step_batch(
        prompt_ids=[[1], [2], [3]],
        response_ids=[[5] * k for k in LENGTHS],
        response_logprobs=[[0.0] * k for k in LENGTHS],
        finish_reasons=["stop"] * 6,
        n=2,
        data_sources=["arithmetic"] * 3,
        ground_truths=["0"] * 3,
        pad_token_id=0,
        response_length=4,
    )
    batch.scores = torch.tensor(SCORES)
    if estimator == "remax":
        batch.reward_baselines = torch.tensor(GREEDY).repeat_interleave(2)
    trainer.algorithm.advantages(batch)
    return batch.advantages


def _on_valid_tokens(per_sample: list[float]) -> list[list[float]]:
    return [[value if t < k else 0.0 for t in range(4)] for value, k in zip(per_sample, LENGTHS)]


def _expected(estimator: str) -> list[float]:
    if estimator == "remax":  # reward-to-go (the score on every valid token) minus the greedy reward
        return [1.0 - 0.5, 0.0 - 0.5, 0.5 - 1.0, 0.0, 2.0 - 1.5, 1.0 - 1.5]
    if estimator == "opo":  # baselines (3·1 + 1·0)/4, (2·0.5 + 0·0)/2, (3·2 + 2·1)/5
        return [1.0 - 0.75, 0.0 - 0.75, 0.5 - 0.5, 0.0, 2.0 - 1.6, 1.0 - 1.6]
    if estimator == "gpg":  # α = 6 samples / 4 nonzero scores; group means 0.5, 0.25, 1.5
        return [1.5 * 0.5, 1.5 * -0.5, 1.5 * 0.25, 0.0, 1.5 * 0.5, 1.5 * -0.5]
    # grpo_passk: best minus second-best over (unbiased std + 1e-6), on the best response only
    return [
        1.0 / (math.sqrt(0.5) + 1e-6),
        0.0,
        0.5 / (math.sqrt(0.125) + 1e-6),
        0.0,
        1.0 / (math.sqrt(0.5) + 1e-6),
        0.0,
    ]


@pytest.mark.parametrize("estimator", ["remax", "opo", "gpg", "grpo_passk"])
def test_override_selects_the_estimator(tmp_path, estimator):
    advantages = _advantages(tmp_path, estimator)
    expected = _on_valid_tokens(_expected(estimator))
    assert advantages.tolist() == [pytest.approx(row, abs=1e-6) for row in expected]
