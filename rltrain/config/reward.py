"""Rule-based rewards, chosen per example by its ``data_source``; scored in the driver or in Ray CPU tasks."""

from __future__ import annotations

from dataclasses import dataclass, field

from rltrain.config.fields import NonNegativeInt


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

    def validate(self, prefix: str) -> list[str]:
        if self.correct_score < self.format_score:
            return [
                f"{prefix}.correct_score={self.correct_score} is below {prefix}.format_score={self.format_score}"
            ]
        return []
