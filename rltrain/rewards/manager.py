"""Score a batch of decoded responses with the rule reward of each row's data_source.

Contract: :class:`RewardManager` is built once from the reward settings; calling it with the
responses of a step and their ground truths and data sources returns a per-sequence score
tensor and the ``reward/*`` metrics (names in :mod:`rltrain.logging.metrics`). The score of a
sequence is ``task_score + format_coef * format_reward`` where ``format_reward`` is 1 when the
response matches ``format_pattern`` entirely (and the term is absent without a pattern).

Per-data_source keyword arguments (``method``, ``correct_score``, ``format_score``) are checked
against the reward function's signature when the manager is built, so a misspelled key fails
before the first rollout.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rltrain.logging import metrics as mk
from rltrain.rewards.format import compile_format_pattern, format_reward
from rltrain.rewards.registry import RewardResult, get_reward_fn


@dataclass
class RewardOutput:
    """Rewards of one batch of responses."""

    scores: torch.Tensor
    """[batch] float32 sequence-level reward (task score plus format bonus)."""

    correct: torch.Tensor
    """[batch] bool, whether the extracted answer matched the ground truth."""

    results: list[RewardResult]
    """The task reward function's result per sequence (extracted answers for debugging)."""

    metrics: dict[str, float]
    """``reward/...`` metrics of the batch."""


def _check_kwargs(data_source: str, kwargs: Mapping[str, Any]) -> None:
    params = inspect.signature(get_reward_fn(data_source)).parameters
    accepted = sorted(name for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(
            f"reward kwargs for data_source {data_source!r}: unknown {unknown}; accepted: {accepted}"
        )


class RewardManager:
    """Rule-based rewards by data_source for a batch of decoded responses."""

    def __init__(
        self,
        *,
        reward_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        format_pattern: str | None = None,
        format_coef: float = 0.0,
    ) -> None:
        """
        Args:
            reward_kwargs: per data_source keyword arguments of its reward function, e.g.
                ``{"gsm8k": {"method": "flexible", "format_score": 0.1}}``.
            format_pattern: regex the whole response must match to earn the format bonus.
            format_coef: weight of the format bonus; needs ``format_pattern`` when non-zero.
        """
        self.reward_kwargs = {ds: dict(kw) for ds, kw in (reward_kwargs or {}).items()}
        for data_source, kwargs in self.reward_kwargs.items():
            _check_kwargs(data_source, kwargs)
        if format_coef != 0.0 and format_pattern is None:
            raise ValueError(f"format_coef={format_coef} needs a format_pattern")
        self.format_pattern = compile_format_pattern(format_pattern) if format_pattern else None
        self.format_coef = format_coef

    def __call__(
        self,
        responses: Sequence[str],
        *,
        ground_truths: Sequence[str],
        data_sources: Sequence[str],
    ) -> RewardOutput:
        if not len(responses) == len(ground_truths) == len(data_sources):
            raise ValueError(
                f"batch sizes differ: {len(responses)} responses, {len(ground_truths)} ground truths, "
                f"{len(data_sources)} data sources"
            )
        if not responses:
            raise ValueError("cannot score an empty batch of responses")
        results = [
            get_reward_fn(ds)(response, truth, **self.reward_kwargs.get(ds, {}))
            for response, truth, ds in zip(responses, ground_truths, data_sources)
        ]
        scores = [r.score for r in results]
        metrics: dict[str, float] = {}
        if self.format_pattern is not None:
            format_hits = [format_reward(response, self.format_pattern) for response in responses]
            scores = [s + self.format_coef * f for s, f in zip(scores, format_hits)]
            metrics[mk.REWARD_FORMAT_MEAN] = sum(format_hits) / len(format_hits)
        metrics.update(mk.summary_stats("reward/score", scores))
        metrics[mk.REWARD_ACCURACY] = sum(r.correct for r in results) / len(results)
        metrics[mk.REWARD_ANSWERED] = sum(r.answer is not None for r in results) / len(results)
        metrics.update(_by_source_metrics(scores, results, data_sources))
        return RewardOutput(
            scores=torch.tensor(scores, dtype=torch.float32),
            correct=torch.tensor([r.correct for r in results], dtype=torch.bool),
            results=results,
            metrics=metrics,
        )


def _by_source_metrics(
    scores: Sequence[float], results: Sequence[RewardResult], data_sources: Sequence[str]
) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for source in sorted(set(data_sources)):
        rows = [i for i, ds in enumerate(data_sources) if ds == source]
        prefix = f"reward/by_source/{source}"
        metrics[f"{prefix}/score_mean"] = sum(scores[i] for i in rows) / len(rows)
        metrics[f"{prefix}/accuracy"] = sum(results[i].correct for i in rows) / len(rows)
        metrics[f"{prefix}/count"] = float(len(rows))
    return metrics
