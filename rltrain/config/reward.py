"""Rewards: rule functions chosen per example by its ``data_source`` (a sandboxed code reward among
them), or a custom function or a remote service scoring every row; a format bonus; scored in the
driver or in Ray CPU tasks."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any

from rltrain.config.fields import AtLeast, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from rltrain.config.reward_model import RewardModelConfig


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping (verl's ``reward_model.overlong_buffer``): a response longer
    than ``rollout.response_length - len`` tokens loses ``penalty_factor`` × the fraction of the
    buffer it ran into: ``score += min(0, -(length - (response_length - len)) / len × penalty_factor)``,
    so a response that fills the whole budget loses ``penalty_factor``. Training rewards only;
    validation scores are not shaped."""

    enable: bool = False
    """Shape the training rewards of long responses."""

    len: NonNegativeInt = 0
    """Tokens at the end of the response budget where the penalty grows; > 0 and below
    ``rollout.response_length`` with ``enable``."""

    penalty_factor: float = 1.0
    """Penalty of a response that uses the whole budget; >= 0."""

    log: bool = True
    """Log ``reward/overlong_frac`` and ``reward/overlong_penalty_mean`` each step."""

    def validate(self, prefix: str, response_length: int) -> list[str]:
        if not self.enable:
            return []
        problems = []
        if not 0 < self.len < response_length:
            problems.append(
                f"{prefix}.len={self.len} must lie in (0, rollout.response_length={response_length})"
            )
        if not self.penalty_factor >= 0:
            problems.append(f"{prefix}.penalty_factor must be >= 0, got {self.penalty_factor}")
        return problems


@dataclass
class CustomRewardFunctionConfig:
    """A reward function in a Python file of yours (verl's ``custom_reward_function``): when ``path``
    is set it scores every row, called as ``name(data_source=, solution_str=, ground_truth=,
    extra_info=, **reward_kwargs)``, and answers a number, a bool or a dict with a numeric
    ``score`` (its other keys are logged as ``reward/extra/<key>/mean``)."""

    path: str | None = None
    """The ``.py`` file (relative to the working directory); null: the rule rewards by data_source."""

    name: str = "compute_score"
    """The function in ``path``."""

    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments passed to every call."""

    def validate(self, prefix: str) -> list[str]:
        if self.path is not None and not self.name.isidentifier():
            return [f"{prefix}.name={self.name!r} is not a Python function name"]
        return []


@dataclass
class RemoteRewardConfig:
    """A scoring service: each response is POSTed as JSON ``{data_source, solution_str, ground_truth,
    extra_info}`` and the answer ``{"score": number, ...}`` is its reward, for every row."""

    enable: bool = False
    """Score every row by asking ``url``."""

    url: str | None = None
    """``http://`` or ``https://`` address to POST to; needed with ``enable``."""

    timeout_s: PositiveFloat = 30.0
    """Seconds to wait for the service at each step of a request (connecting, each read)."""

    max_retries: NonNegativeInt = 3
    """Further tries after a timeout, a failed connection or a 5xx/429 answer; 0: none."""

    backoff_s: NonNegativeFloat = 1.0
    """Wait before the first retry, doubled for each later one; 0 retries at once."""

    max_concurrency: PositiveInt = 16
    """Requests in flight at once, per scoring process (each of ``reward.num_workers`` has its own)."""

    def validate(self, prefix: str) -> list[str]:
        if not self.enable:
            return []
        if self.url is None:
            return [f"{prefix}.enable needs {prefix}.url"]
        if not re.match(r"https?://[^/\s]+", self.url):
            return [f"{prefix}.url={self.url!r} is not an http:// or https:// address"]
        return []


@dataclass
class CodeSandboxConfig:
    """Limits of the sandbox the ``code`` reward runs a response's program in (no network, no other
    processes, files only in a scratch directory)."""

    timeout_s: PositiveFloat = 10.0
    """Wall-clock seconds for all tests of one response together (and as many CPU seconds, rounded up)."""

    memory_mb: Annotated[int, AtLeast(64)] = 512
    """Address-space limit of the program in MB; at least 64 (the interpreter itself needs about 30)."""


@dataclass
class RewardConfig:
    correct_score: float = 1.0
    """Score of a correct final answer."""

    format_score: float = 0.0
    """Score of a well-formed but wrong answer (e.g. a ``#### n`` line with the wrong n)."""

    source_overrides: dict[str, str] = field(default_factory=dict)
    """Map a ``data_source`` to a registered reward function name when they differ."""

    num_workers: NonNegativeInt = 0
    """Ray CPU tasks that score a step's responses in parallel (Ray mode); 0 scores in the driver."""

    launch_reward_fn_async: bool = False
    """Score a step's responses on a thread of the driver while the old log-probs, reference
    log-probs and values are computed, joining before the advantages (verl's
    ``reward_model.launch_reward_fn_async``): a reward with latency (a remote judge, a sandbox)
    stops adding to the step. Same scores, same metrics; ``timing_s/reward`` is then the time the
    step still waited for them. Not with ``algorithm.filter_groups`` (its next round needs the
    scores at once)."""

    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's overlong reward shaping (off by default)."""

    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A learned reward model scoring beside (or instead of) the rules (off by default)."""

    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    """A reward function from a file of yours, scoring every row (off by default)."""

    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)
    """A scoring service, for every row (off by default)."""

    sandbox: CodeSandboxConfig = field(default_factory=CodeSandboxConfig)
    """Limits of the ``code`` reward's sandbox."""

    format_pattern: str | None = None
    """Regular expression the whole stripped response must match for the format bonus (``.`` matches
    newlines); null: none. Logged as ``reward/format/mean`` even when ``format_coef`` is 0."""

    format_coef: float = 0.0
    """Added to the score × whether the response matches ``format_pattern``; needs the pattern when not 0."""

    def validate(self, prefix: str) -> list[str]:
        problems = self.reward_model.validate(f"{prefix}.reward_model")
        if self.correct_score < self.format_score:
            problems.append(
                f"{prefix}.correct_score={self.correct_score} is below {prefix}.format_score={self.format_score}"
            )
        problems += self._scorer_problems(prefix)
        return problems

    def _scorer_problems(self, prefix: str) -> list[str]:
        problems = [
            *self.custom_reward_function.validate(f"{prefix}.custom_reward_function"),
            *self.remote.validate(f"{prefix}.remote"),
        ]
        if self.custom_reward_function.path is not None and self.remote.enable:
            problems.append(
                f"{prefix}.custom_reward_function.path and {prefix}.remote.enable are both set; "
                "each scores every row: keep one"
            )
        if self.format_pattern == "":
            problems.append(f"{prefix}.format_pattern is empty; null for no format bonus")
        elif self.format_pattern is not None:
            try:
                re.compile(self.format_pattern, re.DOTALL)
            except re.error as err:
                problems.append(
                    f"{prefix}.format_pattern={self.format_pattern!r} is not a valid regular expression: {err}"
                )
        elif math.isfinite(self.format_coef) and self.format_coef != 0:
            problems.append(f"{prefix}.format_coef={self.format_coef} needs {prefix}.format_pattern")
        return problems
