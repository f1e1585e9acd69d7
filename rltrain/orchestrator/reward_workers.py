"""Rewards scored in Ray CPU tasks (``reward.num_workers``), for verifiers too slow for the driver.

The rows of a step are cut into ``num_workers`` contiguous chunks; each chunk is scored by the same
:class:`~rltrain.rewards.RewardManager` in a Ray task (:meth:`~rltrain.rewards.RewardManager.score_rows`),
and the results come back in row order, so the metrics and scores are exactly those of scoring in the
driver. The manager travels pickled; a custom reward function travels as its file's path and is
loaded again in the task (:mod:`rltrain.rewards.custom`). A step whose chunks are not all scored
within ``timeout_s`` (``trainer.timeouts.reward_s``) cancels the rest and raises
:class:`RewardTimeout` in one line; a task that fails with one of the one-line errors (a custom
reward's bad answer, a remote scorer that does not answer) raises that error itself in the driver.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ray
import ray.exceptions

from rltrain.config.recipe import ConfigError
from rltrain.config.trainer import TimeoutConfig
from rltrain.errors import RunStopped
from rltrain.rewards import RewardManager, RewardOutput, RewardResult
from rltrain.rewards.manager import Row


class RewardTimeout(RunStopped):
    """Reward tasks did not finish scoring a step in time (a reward function that hangs)."""


@ray.remote(num_cpus=0.5)
def _score_chunk(manager: RewardManager, rows: list[Row]) -> list[RewardResult]:
    return manager.score_rows(rows)


class RayRewardPool:
    """Callable like a RewardManager; scores in ``num_workers`` Ray tasks."""

    def __init__(
        self, manager: RewardManager, num_workers: int, *, timeout_s: float = TimeoutConfig.reward_s
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.manager = manager
        self.num_workers = num_workers
        self.timeout_s = timeout_s

    def _score_rows(self, manager: RewardManager, rows: list[Row]) -> list[RewardResult]:
        size = -(-len(rows) // self.num_workers)
        chunks = [rows[i : i + size] for i in range(0, len(rows), size)]
        shared = ray.put(manager)
        refs = [_score_chunk.remote(shared, chunk) for chunk in chunks]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        if pending:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise RewardTimeout(
                f"reward workers: {len(pending)} of {len(refs)} chunks of the step's {len(rows)} responses "
                f"not scored within {self.timeout_s:g} s (trainer.timeouts.reward_s): a reward function "
                "that hangs?"
            )
        try:
            parts = ray.get(refs)
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, RunStopped | ConfigError):  # its message says everything
                raise err.cause from None
            raise
        return [r for part in parts for r in part]

    def __call__(
        self,
        responses: Sequence[str],
        *,
        ground_truths: Sequence[str],
        data_sources: Sequence[str],
        extra_infos: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardOutput:
        return self.manager(
            responses,
            ground_truths=ground_truths,
            data_sources=data_sources,
            extra_infos=extra_infos,
            score_rows=self._score_rows,
        )
