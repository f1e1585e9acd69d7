"""Rule-based rewards, chosen per example by its ``data_source``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RewardConfig:
    correct_score: float = 1.0
    """Score of a correct final answer."""

    format_score: float = 0.0
    """Score of a well-formed but wrong answer (e.g. a ``#### n`` line with the wrong n)."""

    source_overrides: dict[str, str] = field(default_factory=dict)
    """Map a ``data_source`` to a registered reward function name when they differ."""

    num_workers: int = 0
    """CPU worker processes for scoring; 0 scores in the driver."""

    def validate(self, prefix: str) -> list[str]:
        if self.num_workers < 0:
            return [f"{prefix}.num_workers must be >= 0, got {self.num_workers}"]
        return []
