"""DAPO's dynamic sampling (``algorithm.filter_groups``): further rounds of the data loader's prompts
until ``data.train_batch_size`` groups vary in the chosen metric. The filtering itself is
:func:`~rltrain.trainer.dynamic_sampling.fill_batch`; this is the part the algorithm owns: how a
round is generated (the step's sampling settings, a seed of its own per round, sample ids
``step<k>-r<round>``). DAPO's other parts are settings of the losses and rewards (``clip_ratio_high``,
``loss_agg_mode: token-mean``, ``reward.overlong_buffer``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from rltrain.data.step_batch import step_uid_prefix
from rltrain.trainer.dynamic_sampling import ScoredRound, fill_batch, round_seed

if TYPE_CHECKING:
    from rltrain.config import RLConfig
    from rltrain.trainer.algorithms.base import StepRollouts


class DynamicSampling:
    """Fills a step's batch with groups that vary (``algorithm.filter_groups``)."""

    def __init__(self, config: RLConfig) -> None:
        self.config = config

    def fill(
        self, rollouts: StepRollouts, step: int, first: ScoredRound
    ) -> tuple[ScoredRound, dict[str, float]]:
        """``first`` and as many further rounds as it takes, filtered to the step's batch; the
        ``dynamic_sampling/*`` metrics."""

        def more(round_: int) -> ScoredRound:
            sampling = rollouts.sampling(step)
            sampling = replace(sampling, seed=round_seed(sampling.seed, round_))
            return rollouts.generate_and_score(
                rollouts.next_prompts(), sampling, uid_prefix=step_uid_prefix(step, f"r{round_}")
            )

        batch, prompts, metrics = fill_batch(
            first,
            more,
            config=self.config.algorithm.filter_groups,
            train_batch_size=self.config.data.train_batch_size,
            n=self.config.rollout.n,
            pad_token_id=rollouts.pad_token_id,
            step=step,
        )
        return ScoredRound(prompts, batch, None), metrics
