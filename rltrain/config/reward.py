"""Rule-based rewards, chosen per example by its ``data_source``; scored in the driver or in Ray CPU tasks."""

from __future__ import annotations

from dataclasses import dataclass, field

from rltrain.config.fields import NonNegativeInt


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
class RewardConfig:
    correct_score: float = 1.0
    """Score of a correct final answer."""

    format_score: float = 0.0
    """Score of a well-formed but wrong answer (e.g. a ``#### n`` line with the wrong n)."""

    source_overrides: dict[str, str] = field(default_factory=dict)
    """Map a ``data_source`` to a registered reward function name when they differ."""

    num_workers: NonNegativeInt = 0
    """Ray CPU tasks that score a step's responses in parallel (Ray mode); 0 scores in the driver."""

    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's overlong reward shaping (off by default)."""

    def validate(self, prefix: str) -> list[str]:
        if self.correct_score < self.format_score:
            return [
                f"{prefix}.correct_score={self.correct_score} is below {prefix}.format_score={self.format_score}"
            ]
        return []
