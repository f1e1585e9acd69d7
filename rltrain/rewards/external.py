"""Rewards that score every row in place of the data_source registry: a custom function, a remote scorer.

Contract: an :class:`ExternalScorer` gets one :class:`ScoreRequest` per response (verl's four
arguments: ``data_source``, ``solution_str``, ``ground_truth``, ``extra_info``) and returns one
:class:`~rltrain.rewards.registry.RewardResult` per request, in order. Both take verl's answers
(:func:`result_from_answer`): a number or a bool (the score), or a dict whose ``score`` is the score
and whose other keys are kept as :attr:`RewardResult.extra` (verl's ``reward_extra_info``). Whether
the response is ``correct`` is a dict's ``acc`` where it has one (verl's DAPO math reward names it
so), else ``score >= reward.correct_score``; the extracted ``answer`` is a dict's ``pred`` (verl's
name), else None. Anything else, or a score that is NaN or infinite, stops the run with
:class:`RewardError` naming where it came from.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rltrain.errors import RunStopped
from rltrain.rewards.registry import RewardResult

SHOWN_CHARS = 120
"""How much of a bad answer an error message quotes."""


class RewardError(RunStopped):
    """A custom or remote reward answered something that is not a score (one line naming the source)."""


@dataclass(frozen=True)
class ScoreRequest:
    """What an external scorer gets for one response (the keyword arguments verl passes)."""

    data_source: str
    """The row's ``data_source``."""

    solution_str: str
    """The decoded response."""

    ground_truth: str
    """The row's reference answer."""

    extra_info: Mapping[str, Any] = field(default_factory=dict)
    """The row's ``extra_info`` (empty where the caller has none)."""


class ExternalScorer(Protocol):
    """Scores every row of a batch (a custom function, a remote scorer)."""

    def score_requests(self, requests: Sequence[ScoreRequest]) -> list[RewardResult]:
        """One result per request, in order."""
        ...


def _is_number(value: Any) -> bool:
    return isinstance(value, bool | numbers.Real) or type(value).__name__ == "bool_"  # numpy's bool


def shown(value: Any) -> str:
    """``repr(value)``, cut to :data:`SHOWN_CHARS` characters."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def result_from_answer(
    answer: Any, *, correct_score: float, origin: str, request: ScoreRequest
) -> RewardResult:
    """The :class:`RewardResult` of a verl-style answer; :class:`RewardError` naming ``origin``
    (the config key or URL) and the row's data_source when it is not one."""
    where = f"{origin}: for data_source {request.data_source!r}"
    extra: dict[str, Any] = {}
    if isinstance(answer, Mapping):
        if "score" not in answer:
            raise RewardError(
                f"{where} the answer {shown(dict(answer))} has no 'score' key; a reward answers a number, "
                "a bool or a dict with a numeric 'score'"
            )
        score = answer["score"]
        extra = {str(k): v for k, v in answer.items() if k != "score"}
        if not _is_number(score):
            raise RewardError(
                f"{where} the answer's 'score' is {shown(score)} ({type(score).__name__}), not a number"
            )
    elif _is_number(answer):
        score = answer
    else:
        raise RewardError(
            f"{where} the answer is {shown(answer)} ({type(answer).__name__}); a reward answers a number, "
            "a bool or a dict with a numeric 'score'"
        )
    value = float(score)
    if not math.isfinite(value):
        raise RewardError(f"{where} the score is {value}; it must be finite")
    correct = bool(extra["acc"]) if "acc" in extra else value >= correct_score
    pred = extra.get("pred")
    return RewardResult(score=value, correct=correct, answer=None if pred is None else str(pred), extra=extra)
