"""Rule rewards scored in Ray CPU tasks (``reward.num_workers``), for verifiers too slow for the driver.

The rows of a step are cut into ``num_workers`` contiguous chunks; each chunk is scored by the same
:class:`~rltrain.rewards.RewardManager` in a Ray task, and the results come back in row order, so
the metrics and scores are exactly those of scoring in the driver.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray

from rltrain.rewards import RewardManager, RewardOutput, RewardResult


@ray.remote(num_cpus=0.5)
def _score_chunk(manager: RewardManager, rows: list[tuple[str, str, str]]) -> list[RewardResult]:
    return [manager.score_one(*row) for row in rows]


class RayRewardPool:
    """Callable like a RewardManager; scores in ``num_workers`` Ray tasks."""

    def __init__(self, manager: RewardManager, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.manager = manager
        self.num_workers = num_workers

    def _score_rows(self, manager: RewardManager, rows: list[tuple[str, str, str]]) -> list[RewardResult]:
        size = -(-len(rows) // self.num_workers)
        chunks = [rows[i : i + size] for i in range(0, len(rows), size)]
        shared = ray.put(manager)
        return [r for part in ray.get([_score_chunk.remote(shared, chunk) for chunk in chunks]) for r in part]

    def __call__(
        self, responses: Sequence[str], *, ground_truths: Sequence[str], data_sources: Sequence[str]
    ) -> RewardOutput:
        return self.manager(
            responses, ground_truths=ground_truths, data_sources=data_sources, score_rows=self._score_rows
        )
