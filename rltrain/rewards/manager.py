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

An external ``scorer`` (:mod:`.custom`: ``reward.custom_reward_function``; :mod:`.remote`:
``reward.remote``) scores every row in place of the registry, as verl's custom reward function does:
data sources need no registered reward then, and the rows' ``extra_info`` reaches it. The format
bonus is added to its scores all the same. Numeric extra keys of its answers are averaged into
``reward/extra/<key>/mean`` over the rows that have them.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rltrain.data.prompt_rows import DataRowError
from rltrain.logging import metrics as mk
from rltrain.rewards.code_exec import CODE_DATA_SOURCES
from rltrain.rewards.external import ExternalScorer, ScoreRequest
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
    from rltrain.data.prompt_rows import PromptExample

Row = tuple[str, str, str] | tuple[str, str, str, Mapping[str, Any]]
"""The positional arguments of :meth:`RewardManager.score_one`: response, ground truth, data_source
and, where the caller has it, the row's extra_info."""


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
        scorer: ExternalScorer | None = None,
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
            scorer: scores every row in place of the registry (a custom function, a remote service).
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
        self.scorer = scorer

    @classmethod
    def from_config(cls, config: RewardConfig) -> RewardManager:
        """Build from the ``reward`` section of a recipe (a custom reward's file is loaded now)."""
        from rltrain.rewards.custom import CustomReward
        from rltrain.rewards.remote import RemoteReward

        scorer: ExternalScorer | None = None
        custom, remote = config.custom_reward_function, config.remote
        if custom.path is not None:
            scorer = CustomReward(
                custom.path,
                name=custom.name,
                reward_kwargs=custom.reward_kwargs,
                correct_score=config.correct_score,
            )
        elif remote.enable:
            assert remote.url is not None  # RewardConfig.validate
            scorer = RemoteReward(
                remote.url,
                timeout_s=remote.timeout_s,
                max_retries=remote.max_retries,
                backoff_s=remote.backoff_s,
                max_concurrency=remote.max_concurrency,
                correct_score=config.correct_score,
            )
        sandbox = {"timeout_s": config.sandbox.timeout_s, "memory_mb": config.sandbox.memory_mb}
        return cls(
            correct_score=config.correct_score,
            format_score=config.format_score,
            source_overrides=config.source_overrides,
            reward_kwargs={name: sandbox for name in CODE_DATA_SOURCES},
            format_pattern=config.format_pattern,
            format_coef=config.format_coef,
            scorer=scorer,
        )

    def score_one(
        self,
        response: str,
        ground_truth: str,
        data_source: str,
        extra_info: Mapping[str, Any] | None = None,
    ) -> RewardResult:
        """Score one response with the external scorer, else the reward function of ``data_source``
        (which does not see ``extra_info``)."""
        if self.scorer is not None:
            return self.score_rows([(response, ground_truth, data_source, extra_info or {})])[0]
        name, fn = self._reward_of(data_source)
        return fn(response, ground_truth, **self.reward_kwargs.get(name, self.default_kwargs))

    def score_rows(self, rows: Sequence[Row]) -> list[RewardResult]:
        """One result per row, in order (an external scorer gets the rows together: a remote one
        sends them concurrently)."""
        if self.scorer is not None:
            return self.scorer.score_requests([_request(row) for row in rows])
        return [self.score_one(*row) for row in rows]

    def _reward_of(self, data_source: str) -> tuple[str, RewardFn]:
        name = self.source_overrides.get(data_source, data_source)
        try:
            return name, get_reward_fn(name)
        except UnknownDataSourceError as err:
            raise UnknownDataSourceError(f"{err}; map other names with reward.source_overrides") from None

    def check_examples(self, examples: Iterable[PromptExample]) -> None:
        """Refuse rows this manager cannot score, when the data loads rather than at the first step.

        Raises :class:`~rltrain.data.prompt_rows.DataRowError` naming the first such row (``file:line``),
        why (an unknown data_source, with the registered ones; a ground truth of the wrong kind for
        the reward function) and how many more rows have a problem."""
        if self.scorer is not None:  # it scores every row, whatever its data_source
            return
        problems = []
        for example in examples:
            try:
                name, _ = self._reward_of(example.data_source)
            except UnknownDataSourceError as err:
                problems.append(f"{example.origin}: {err}")
                continue
            problem = ground_truth_problem(name, example.ground_truth)
            if problem:
                truth = example.ground_truth
                shown = repr(truth) if len(truth) <= 80 else repr(truth[:77]) + "..."
                problems.append(
                    f"{example.origin}: ground truth {shown} {problem}, which the "
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
        extra_infos: Sequence[Mapping[str, Any]] | None = None,
        score_rows: Callable[[RewardManager, list[Row]], list[RewardResult]] | None = None,
    ) -> RewardOutput:
        """Score ``responses[i]`` against ``ground_truths[i]`` by ``data_sources[i]``; an external
        scorer also gets ``extra_infos[i]`` (``{}`` without them).

        ``score_rows(manager, rows)`` may score the rows (:data:`Row`) elsewhere (e.g. in CPU
        worker processes); it must return one result per row, in order.
        """
        if not len(responses) == len(ground_truths) == len(data_sources):
            raise ValueError(
                f"batch sizes differ: {len(responses)} responses, {len(ground_truths)} ground truths, "
                f"{len(data_sources)} data sources"
            )
        if extra_infos is not None and len(extra_infos) != len(responses):
            raise ValueError(
                f"batch sizes differ: {len(responses)} responses, {len(extra_infos)} extra_infos"
            )
        if not responses:
            raise ValueError("cannot score an empty batch of responses")
        rows: list[Row] = (
            list(zip(responses, ground_truths, data_sources))
            if extra_infos is None
            else list(zip(responses, ground_truths, data_sources, extra_infos))
        )
        results = score_rows(self, rows) if score_rows is not None else self.score_rows(rows)
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
        metrics.update(_extra_metrics(results))
        return RewardOutput(
            scores=torch.tensor(scores, dtype=torch.float32),
            correct=torch.tensor([r.correct for r in results], dtype=torch.bool),
            results=results,
            metrics=metrics,
        )


def _request(row: Row) -> ScoreRequest:
    response, ground_truth, data_source, *extra = row
    return ScoreRequest(
        data_source=data_source,
        solution_str=response,
        ground_truth=ground_truth,
        extra_info=dict(extra[0] or {}) if extra else {},
    )


def _extra_metrics(results: Sequence[RewardResult]) -> dict[str, float]:
    """``reward/extra/<key>/mean`` of each extra key with a finite number (or bool) for its value."""
    values: dict[str, list[float]] = {}
    for result in results:
        for key, value in result.extra.items():
            if isinstance(value, bool | int | float) and math.isfinite(value):
                values.setdefault(key, []).append(float(value))
    return {f"reward/extra/{key}/mean": math.fsum(v) / len(v) for key, v in sorted(values.items())}


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
