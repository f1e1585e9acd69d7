"""ReMax (``algorithm.adv_estimator: remax``): each prompt's greedy response is generated and scored
at the step, with the step's weights, and its reward is the baseline the sampled responses'
rewards are measured against (:func:`rltrain.algo.advantages.remax`).

Also the example of adding an algorithm: a subclass of :class:`~rltrain.trainer.algorithms.base.Algorithm`
registered for its estimator, overriding what it adds to the step (here: one extra rollout).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from rltrain.data.step_batch import step_uid_prefix
from rltrain.trainer.algorithms.base import Algorithm, StepRollouts, register_algorithm
from rltrain.trainer.dynamic_sampling import ScoredRound, group_values

if TYPE_CHECKING:
    import torch

    from rltrain.data.loader import PromptBatch


@register_algorithm("remax")
class ReMax(Algorithm):
    """PPO without a critic, the greedy response's reward as each prompt's baseline."""

    def extra_rollouts(
        self, rollouts: StepRollouts, step: int, first: ScoredRound
    ) -> tuple[ScoredRound, dict[str, float]]:
        scored, metrics = super().extra_rollouts(rollouts, step, first)
        baselines = greedy_baselines(rollouts, scored.prompts, step)
        scored.batch.reward_baselines = baselines.repeat_interleave(self.config.rollout.n)
        return scored, metrics


def greedy_baselines(rollouts: StepRollouts, prompts: PromptBatch, step: int) -> torch.Tensor:
    """``[prompts]``: the reward of each prompt's greedy response, scored and shaped as the samples
    are, an interaction's turn rewards included."""
    sampling = replace(rollouts.sampling(step), temperature=0.0, top_p=1.0, top_k=-1, n=1)
    greedy = rollouts.generate_and_score(prompts, sampling, uid_prefix=step_uid_prefix(step, "greedy"))
    return group_values(greedy, "seq_reward")
