"""Score a batch of decoded responses with the rule reward of each row's data_source.

Contract: :class:`RewardManager` is built once from the reward settings; calling it with the
responses of a step and their ground truths and data sources returns a per-sequence score
tensor and the ``reward/*`` metrics (names in :mod:`rltrain.logging.metrics`). The score of a
sequence is ``task_score + format_coef * format_reward`` where ``format_reward`` is 1 when the
response matches ``format_pattern`` entirely (and the term is absent without a pattern).

Every reward function receives ``correct_score`` and ``format_score``; ``source_overrides`` maps
a data_source to a registered reward under another name (``{"my_math": "gsm8k"}``). Further
keyword arguments per reward (``{"gsm8k": {"method": "flexible"}}``) are checked against the
function's signature when the manager is built, so a misspelled key fails before the first
rollout, as does an override naming an unregistered reward. :meth:`RewardManager.check_examples`
checks loaded prompts the same way: each row's data_source must have a reward function and its
ground truth must be one that function can score.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rltrain.data.dataset import DataRowError
from rltrain.logging import metrics as mk
from rltrain.rewards.format import compile_format_pattern, format_reward
from rltrain.rewards.registry import (
    RewardFn,
    RewardResult,
    UnknownDataSourceError,
    get_reward_fn,
    ground_truth_problem,
)

if TYPE_CHECKING:
    from rltrain.config.reward import RewardConfig
    from rltrain.data.dataset import PromptExample


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


class RewardManager:
    """Rule-based rewards by data_source for a batch of decoded responses."""

    def __init__(
        self,
        *,
        correct_score: float = 1.0,
        format_score: float = 0.0,
        source_overrides: Mapping[str, str] | None = None,
        reward_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        format_pattern: str | None = None,
        format_coef: float = 0.0,
    ) -> None:
        """
        Args:
            correct_score: score of a correct answer, passed to every reward function.
            format_score: score of a wrong but extractable answer, passed to every reward function.
            source_overrides: data_source -> registered reward name, for sources named otherwise.
            reward_kwargs: further keyword arguments per registered reward name, e.g.
                ``{"gsm8k": {"method": "flexible"}}``.
            format_pattern: regex the whole response must match to earn the format bonus.
            format_coef: weight of the format bonus; needs ``format_pattern`` when non-zero.
        """
        self.source_overrides = dict(source_overrides or {})
        for target in self.source_overrides.values():
            get_reward_fn(target)
        self.reward_kwargs = {
            name: {"correct_score": correct_score, "format_score": format_score, **kwargs}
            for name, kwargs in (reward_kwargs or {}).items()
        }
        for name, kwargs in self.reward_kwargs.items():
            _check_kwargs(name, kwargs)
        self.default_kwargs = {"correct_score": correct_score, "format_score": format_score}
        if format_coef != 0.0 and format_pattern is None:
            raise ValueError(f"format_coef={format_coef} needs a format_pattern")
        self.format_pattern = compile_format_pattern(format_pattern) if format_pattern else None
        self.format_coef = format_coef

    @classmethod
    def from_config(cls, config: RewardConfig) -> RewardManager:
        """Build from the ``reward`` section of a recipe."""
        return cls(
            correct_score=config.correct_score,
            format_score=config.format_score,
            source_overrides=config.source_overrides,
        )

    def score_one(self, response: str, ground_truth: str, data_source: str) -> RewardResult:
        """Score one response with the reward function of ``data_source``."""
        name, fn = self._reward_of(data_source)
        return fn(response, ground_truth, **self.reward_kwargs.get(name, self.default_kwargs))

    def _reward_of(self, data_source: str) -> tuple[str, RewardFn]:
        name = self.source_overrides.get(data_source, data_source)
        try:
            return name, get_reward_fn(name)
        except UnknownDataSourceError as err:
            raise UnknownDataSourceError(f"{err}; map other names with reward.source_overrides") from None

    def check_examples(self, examples: Iterable[PromptExample]) -> None:
        """Refuse rows this manager cannot score, when the data loads rather than at the first step.

        Raises :class:`~rltrain.data.dataset.DataRowError` naming the first such row (``file:line``),
        why (an unknown data_source, with the registered ones; a ground truth of the wrong kind for
        the reward function) and how many more rows have a problem."""
        problems = []
        for example in examples:
            try:
                name, _ = self._reward_of(example.data_source)
            except UnknownDataSourceError as err:
                problems.append(f"{example.origin}: {err}")
                continue
            problem = ground_truth_problem(name, example.ground_truth)
            if problem:
                problems.append(
                    f"{example.origin}: ground truth {example.ground_truth!r} {problem}, which the "
                    f"{name!r} reward of data_source {example.data_source!r} needs"
                )
        if problems:
            more = f" ({len(problems) - 1} more rows have a problem)" if len(problems) > 1 else ""
            raise DataRowError(problems[0] + more)

    def __call__(
        self,
        responses: Sequence[str],
        *,
        ground_truths: Sequence[str],
        data_sources: Sequence[str],
        score_rows: Callable[[RewardManager, list[tuple[str, str, str]]], list[RewardResult]] | None = None,
    ) -> RewardOutput:
        """Score ``responses[i]`` against ``ground_truths[i]`` by ``data_sources[i]``.

        ``score_rows(manager, rows)`` may score the ``(response, ground_truth, data_source)`` rows
        elsewhere (e.g. in CPU worker processes); it must return one result per row, in order.
        """
        if not len(responses) == len(ground_truths) == len(data_sources):
            raise ValueError(
                f"batch sizes differ: {len(responses)} responses, {len(ground_truths)} ground truths, "
                f"{len(data_sources)} data sources"
            )
        if not responses:
            raise ValueError("cannot score an empty batch of responses")
        rows = list(zip(responses, ground_truths, data_sources))
        results = score_rows(self, rows) if score_rows is not None else [self.score_one(*row) for row in rows]
        if len(results) != len(rows):
            raise RuntimeError(f"score_rows returned {len(results)} results for {len(rows)} rows")
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


def _check_kwargs(name: str, kwargs: Mapping[str, Any]) -> None:
    params = inspect.signature(get_reward_fn(name)).parameters
    accepted = sorted(p for p, spec in params.items() if spec.kind is inspect.Parameter.KEYWORD_ONLY)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(f"reward kwargs for {name!r}: unknown {unknown}; accepted: {accepted}")


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
