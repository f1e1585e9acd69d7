"""Optimizer and learning-rate schedule of one trainable role (actor or critic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rltrain.config.fields import NonNegativeFloat, NonNegativeInt, PositiveFloat


@dataclass
class OptimConfig:
    lr: PositiveFloat = 1e-6
    """Peak learning rate (verl: ``actor.optim.lr`` 1e-6, ``critic.optim.lr`` 1e-5)."""

    min_lr: float = 0.0
    """Learning rate at the end of the decay."""

    weight_decay: NonNegativeFloat = 0.01
    """Decoupled (AdamW) weight decay; norms and biases are excluded."""

    betas: tuple[float, float] = (0.9, 0.999)
    """Adam beta1 and beta2."""

    eps: PositiveFloat = 1e-8
    """Adam epsilon."""

    clip_grad: NonNegativeFloat = 1.0
    """Global gradient-norm clip (over all ranks); 0 disables clipping."""

    lr_warmup_steps: NonNegativeInt = 0
    """Linear warm-up steps from 0 to ``lr``; takes precedence over ``lr_warmup_steps_ratio`` when > 0."""

    lr_warmup_steps_ratio: float = 0.0
    """Warm-up as a fraction of the total optimizer steps (used when ``lr_warmup_steps`` is 0)."""

    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up, down to ``min_lr`` at the last optimizer step."""

    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron's distributed optimizer)."""

    def validate(self, prefix: str) -> list[str]:
        problems = []
        if not 0 <= self.min_lr <= self.lr:
            problems.append(f"{prefix}.min_lr must lie in [0, lr={self.lr}], got {self.min_lr}")
        if not 0.0 <= self.lr_warmup_steps_ratio < 1.0:
            problems.append(
                f"{prefix}.lr_warmup_steps_ratio must lie in [0, 1), got {self.lr_warmup_steps_ratio}"
            )
        if any(not 0.0 <= b < 1.0 for b in self.betas):
            problems.append(f"{prefix}.betas must lie in [0, 1), got {list(self.betas)}")
        return problems
