"""Registry of rule-based reward functions, keyed by a row's ``data_source``.

Contract: a reward function takes the decoded response text and the ground-truth string of one
sequence, plus keyword-only parameters, at least ``correct_score`` and ``format_score`` (the
manager passes both), and returns a :class:`RewardResult`. It is pure: no model, no I/O, no
randomness, so the same response always gets the same score (the ``code`` reward runs the
response's program in a sandbox process: the same for a deterministic program within its limits).
Functions are registered under one or more data_source names with :func:`register_reward`;
:func:`get_reward_fn` fails for an unknown name and lists the registered ones. A registration may
name a ground-truth check (``ground_truth=``), which says what is wrong with a ground truth the
function cannot score (a non-numeric answer for a math reward);
:meth:`rltrain.rewards.RewardManager.check_examples` runs it on every row when the data loads.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class RewardResult:
    """The score of one response."""

    score: float
    """Scalar reward of the whole sequence (the algorithm places it on the last response token)."""

    correct: bool
    """Whether the extracted answer equals the ground truth (drives the ``reward/accuracy`` metric)."""

    answer: str | None
    """The answer extracted from the response, normalized; ``None`` when none could be found."""

    extra: dict[str, Any] = field(default_factory=dict)
    """Further keys of a custom or remote reward's dict answer besides ``score`` (verl's
    ``reward_extra_info``); numeric ones are averaged into ``reward/extra/<key>/mean``."""


class RewardFn(Protocol):
    def __call__(self, response: str, ground_truth: str, **kwargs: object) -> RewardResult: ...


GroundTruthCheck = Callable[[str], "str | None"]
"""What is wrong with a ground truth for a reward function (``"is not a number"``), None if usable."""

_REGISTRY: dict[str, RewardFn] = {}
_GROUND_TRUTH_CHECKS: dict[str, GroundTruthCheck] = {}
REQUIRED_KWARGS = frozenset({"correct_score", "format_score"})
"""Keyword-only parameters every reward function takes (the manager always passes them)."""


class UnknownDataSourceError(KeyError):
    """A row's data_source has no registered reward function."""

    def __str__(self) -> str:  # KeyError would repr() the message and show the quotes
        return str(self.args[0])


def register_reward(
    *data_sources: str, ground_truth: GroundTruthCheck | None = None
) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under each of ``data_sources``, with an optional
    check of the ground truths it can score."""
    if not data_sources:
        raise ValueError("register_reward needs at least one data_source name")

    def decorator(fn: RewardFn) -> RewardFn:
        params = inspect.signature(fn).parameters
        keyword_only = {name for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
        if not REQUIRED_KWARGS.issubset(keyword_only):
            raise TypeError(
                f"reward function {fn.__qualname__} must take keyword-only {sorted(REQUIRED_KWARGS)}"
            )
        for name in data_sources:
            if name in _REGISTRY and _REGISTRY[name] is not fn:
                raise ValueError(f"data_source {name!r} already has a reward function: {_REGISTRY[name]}")
            _REGISTRY[name] = fn
            if ground_truth is not None:
                _GROUND_TRUTH_CHECKS[name] = ground_truth
        return fn

    return decorator


def get_reward_fn(data_source: str) -> RewardFn:
    """The reward function registered for ``data_source``; a clear error names the known ones."""
    try:
        return _REGISTRY[data_source]
    except KeyError:
        raise UnknownDataSourceError(
            f"no reward function registered for data_source {data_source!r}; "
            f"registered: {registered_data_sources()}"
        ) from None


def registered_data_sources() -> list[str]:
    """Sorted names of all registered data sources."""
    return sorted(_REGISTRY)


def ground_truth_problem(data_source: str, ground_truth: str) -> str | None:
    """What the reward of ``data_source`` finds wrong with ``ground_truth``; None if it can score it."""
    check = _GROUND_TRUTH_CHECKS.get(data_source)
    return check(ground_truth) if check is not None else None
