"""Advantage estimation and KL regularization."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rltrain.config.fields import NonNegativeFloat, PositiveInt

KLEstimator = Literal["kl", "abs", "mse", "low_var_kl"]


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    """``fixed`` keeps β; ``adaptive`` moves β toward ``target_kl`` (Ziegler et al. 2019)."""

    kl_coef: NonNegativeFloat = 0.001
    """β, the initial KL coefficient in the reward."""

    target_kl: float = 0.1
    """KL per sequence the adaptive controller aims for."""

    horizon: PositiveInt = 10000
    """Samples over which the adaptive controller corrects a KL error (larger = slower)."""


@dataclass
class AlgorithmConfig:
    adv_estimator: Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = (
        "gae"
    )
    """Registered advantage estimator (see rltrain/algo/advantages.py)."""

    gamma: float = 1.0
    """Discount factor."""

    lam: float = 1.0
    """GAE λ."""

    norm_adv_by_std_in_grpo: bool = True
    """GRPO divides by the group's std; false gives the mean-only variant of Dr. GRPO."""

    use_kl_in_reward: bool = False
    """Subtract β·KL(π‖π_ref) per token from the reward."""

    kl_penalty: KLEstimator = "kl"
    """KL estimator for the in-reward penalty."""

    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Controller of β for the in-reward penalty."""

    def validate(self, prefix: str) -> list[str]:
        problems = []
        if not 0 <= self.gamma <= 1:
            problems.append(f"{prefix}.gamma must lie in [0, 1], got {self.gamma}")
        if not 0 <= self.lam <= 1:
            problems.append(f"{prefix}.lam must lie in [0, 1], got {self.lam}")
        if self.kl_ctrl.type == "adaptive":
            if self.kl_ctrl.target_kl <= 0:
                problems.append(f"{prefix}.kl_ctrl.target_kl must be > 0, got {self.kl_ctrl.target_kl}")
            if not self.use_kl_in_reward:
                problems.append(
                    f"{prefix}.kl_ctrl.type=adaptive has no effect without {prefix}.use_kl_in_reward=true"
                )
        return problems
