"""What an RL algorithm adds to the step, as one object built from the config (:func:`build_algorithm`).

The step loop (:meth:`~rltrain.trainer.driver.PPOTrainer.train_step`) is the same for every
algorithm: generate, score, log-probs and values, advantages, updates, weight sync. What differs is
asked of the run's :class:`Algorithm`, and the loop never reads an algorithm setting itself:

- :attr:`Algorithm.needs`: the models it needs besides the actor (critic, reference, reward model,
  teacher); the role table (:mod:`rltrain.orchestrator.role_table`) starts what it names;
- :meth:`Algorithm.extra_rollouts`: rollouts a step adds to its own (DAPO's further rounds of dynamic
  sampling, ReMax's greedy baselines);
- :meth:`Algorithm.shape_rewards`: the token-level rewards from the scores (KL in the reward with
  its controller, an interaction's turn rewards);
- :meth:`Algorithm.estimate`: the advantages and returns (``algorithm.adv_estimator``, looked up in
  the estimator registry of :mod:`rltrain.algo.advantages`);
- :meth:`Algorithm.updates_actor`: whether a step updates the actor (the critic's warm-up);
- :attr:`Algorithm.actor_loss`, :attr:`Algorithm.critic_loss`: the losses the updates minimize, as
  data (:mod:`rltrain.algo.loss_specs`) sent with each update to the ranks, which build each
  mini-batch's loss from them (by default from ``actor.*`` and ``critic.*``:
  :mod:`~rltrain.trainer.algorithms.losses`).

This base class is KL-regularized PPO and the critic-free estimators over it (GRPO, RLOO,
REINFORCE++, OPO, ...). An algorithm that needs more is one subclass in a file of its own in this
package, registered for its ``algorithm.adv_estimator`` with :func:`register_algorithm` (see
:mod:`~rltrain.trainer.algorithms.remax`); :func:`build_algorithm` picks it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from rltrain.algo import (
    AdvantageInputs,
    apply_kl_in_reward,
    build_kl_controller,
    compute_advantages,
    masked_mean,
)
from rltrain.logging import metrics as mk
from rltrain.trainer.algorithms.dapo import DynamicSampling
from rltrain.trainer.algorithms.losses import actor_loss_of, critic_loss_of

if TYPE_CHECKING:
    from rltrain.config import RLConfig
    from rltrain.data.loader import PromptBatch
    from rltrain.data.step_batch import StepBatch
    from rltrain.rollout.types import SamplingConfig
    from rltrain.trainer.dynamic_sampling import ScoredRound


@dataclass(frozen=True)
class Needs:
    """The models an algorithm needs besides the actor (and the rollout engines)."""

    critic: bool
    """A value model (GAE)."""
    reference: bool
    """The frozen initial policy, for a KL penalty (in the reward or as a loss)."""
    reward_model: bool
    """A learned reward model scoring the responses."""
    teacher: bool = False
    """A teacher model whose log-probs the student matches (on-policy distillation)."""


class StepRollouts(Protocol):
    """What an algorithm may ask of the trainer for rollouts beyond the step's own."""

    def sampling(self, step: int) -> SamplingConfig: ...

    def generate_and_score(
        self, prompts: PromptBatch, sampling: SamplingConfig, *, uid_prefix: str
    ) -> ScoredRound: ...

    def next_prompts(self) -> PromptBatch: ...

    @property
    def pad_token_id(self) -> int: ...


class Algorithm:
    """KL-regularized PPO and the estimators that need nothing more (see the module docstring)."""

    def __init__(self, config: RLConfig) -> None:
        self.config = config
        algo = config.algorithm
        self.kl_ctrl = build_kl_controller(
            algo.kl_ctrl.type,
            kl_coef=algo.kl_ctrl.kl_coef,
            target_kl=algo.kl_ctrl.target_kl,
            horizon=algo.kl_ctrl.horizon,
        )
        """β of the KL in the reward (fixed or adaptive); checkpointed with the run."""
        self.dynamic_sampling = DynamicSampling(config) if algo.filter_groups.enable else None
        """DAPO's dynamic sampling (``algorithm.filter_groups.enable``), or None."""
        self.actor_loss = actor_loss_of(config.actor, algo, mtp=config.model.mtp)
        """The actor's loss (``actor.policy_loss``, entropy bonus, KL loss, rollout correction, MTP loss)."""
        self.critic_loss = critic_loss_of(config.critic, config.actor)
        """The critic's clipped value loss."""
        self.needs = Needs(
            critic=config.critic_enabled(),
            reference=algo.use_kl_in_reward or config.actor.use_kl_loss,
            reward_model=config.reward.reward_model.enable,
        )

    def extra_rollouts(
        self, rollouts: StepRollouts, step: int, first: ScoredRound
    ) -> tuple[ScoredRound, dict[str, float]]:
        """The step's scored round after the rollouts this algorithm adds (timed by the rollouts
        themselves as the step's generate and reward), and their metrics."""
        if self.dynamic_sampling is None:
            return first, {}
        return self.dynamic_sampling.fill(rollouts, step, first)

    def shape_rewards(self, batch: StepBatch) -> dict[str, float]:
        """Set ``batch.token_level_rewards`` from ``batch.scores``: each score at its sample's last
        token, minus β·KL per token with ``algorithm.use_kl_in_reward`` (β then updated), plus an
        interaction's turn rewards."""
        algo, mask = self.config.algorithm, batch.response_mask.float()
        metrics: dict[str, float] = {}
        if algo.use_kl_in_reward:
            beta = self.kl_ctrl.value
            batch.token_level_rewards, kl = apply_kl_in_reward(
                scores=batch.scores,
                logprobs=batch.old_logprobs,
                ref_logprobs=batch.ref_logprobs,
                response_mask=mask,
                kl_coef=beta,
                kind=algo.kl_penalty,
            )
            self.kl_ctrl.update(kl.kl_token_mean, n_steps=batch.batch_size)
            metrics |= {
                mk.ACTOR_KL: kl.kl_token_mean,
                mk.ACTOR_KL_COEF: beta,
                mk.ACTOR_KL_SEQ_SUM: kl.kl_seq_sum,
            }
        else:
            batch.token_level_rewards = score_at_last_token(batch.scores, mask)
        if batch.turn_rewards is not None:
            batch.token_level_rewards = batch.token_level_rewards + batch.turn_rewards * mask
            if batch.ref_logprobs is not None:
                metrics[mk.ACTOR_KL] = float(masked_mean(batch.old_logprobs - batch.ref_logprobs, mask))
        return metrics

    def estimate(self, batch: StepBatch) -> dict[str, float]:
        """Set ``batch.advantages`` and ``batch.returns`` (``algorithm.adv_estimator``)."""
        algo, mask = self.config.algorithm, batch.response_mask.float()
        inputs = AdvantageInputs(
            token_level_rewards=batch.token_level_rewards,
            response_mask=mask,
            values=batch.values,
            group_ids=batch.group_ids,
            reward_baselines=batch.reward_baselines,
        )
        out = compute_advantages(
            algo.adv_estimator,
            inputs,
            gamma=algo.gamma,
            lam=algo.lam,
            norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
        )
        batch.advantages, batch.returns = out.advantages, out.returns
        metrics = {
            mk.CRITIC_ADVANTAGES_MEAN: float(masked_mean(out.advantages, mask)),
            mk.CRITIC_RETURNS_MEAN: float(masked_mean(out.returns, mask)),
        }
        if batch.values is not None:
            metrics[mk.CRITIC_VALUES_MEAN] = float(masked_mean(batch.values, mask))
        return metrics

    def advantages(self, batch: StepBatch) -> dict[str, float]:
        """:meth:`shape_rewards`, then :meth:`estimate`; their metrics."""
        return self.shape_rewards(batch) | self.estimate(batch)

    def updates_actor(self, step: int) -> bool:
        """Whether ``step`` updates the actor: not during the critic's warm-up (``critic.warmup_steps``)."""
        return not self.needs.critic or step > self.config.critic.warmup_steps


def score_at_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[batch, response_len]``: each score at its row's last sampled token (the mask may have gaps
    where tool tokens sit; a row without any sampled token gets it at position 0, masked out)."""
    rewards = torch.zeros_like(mask)
    positions = torch.arange(mask.size(-1)).expand_as(mask)
    last = torch.where(mask.bool(), positions, torch.zeros_like(positions)).max(dim=-1).values
    rewards[torch.arange(mask.size(0)), last] = scores.to(rewards.dtype)
    return rewards


ALGORITHMS: dict[str, type[Algorithm]] = {}
"""``algorithm.adv_estimator`` → the algorithm class that needs more than :class:`Algorithm`."""


def register_algorithm(estimator: str) -> Callable[[type[Algorithm]], type[Algorithm]]:
    """Class decorator: runs with ``algorithm.adv_estimator=estimator`` use this class."""

    def register(cls: type[Algorithm]) -> type[Algorithm]:
        if estimator in ALGORITHMS:
            raise ValueError(f"an algorithm is already registered for adv_estimator {estimator!r}")
        ALGORITHMS[estimator] = cls
        return cls

    return register


def build_algorithm(config: RLConfig) -> Algorithm:
    """The run's algorithm: the class registered for its ``algorithm.adv_estimator``, else :class:`Algorithm`."""
    return ALGORITHMS.get(config.algorithm.adv_estimator, Algorithm)(config)
