"""Router options of a mixture-of-experts model that its HF config does not carry.

Megatron-Core's names (``TransformerConfig``), which verl passes through unchanged in
``override_transformer_config``. The defaults keep the family's own routing (what its HF model
does); each option changes training only, and a dense model refuses any of them set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rltrain.config.fields import NonNegativeFloat, PositiveFloat


@dataclass
class MoEConfig:
    moe_z_loss_coeff: PositiveFloat | None = None
    """Coefficient of the router z-loss (mean over tokens of logsumexp(router logits)², ST-MoE);
    null: no z-loss (and no ``moe/z_loss`` metric)."""

    moe_aux_loss_coeff: NonNegativeFloat | None = None
    """Coefficient of Megatron's load-balancing loss; null: the checkpoint's ``router_aux_loss_coef``
    (gpt-oss-20b releases 0.9, which transformers applies only when asked for router logits); 0
    turns the loss off."""

    moe_router_score_function: Literal["softmax", "sigmoid"] | None = None
    """Scores the router ranks experts by; null: the family's (softmax for Mixtral and Qwen-MoE).
    ``sigmoid`` (DeepSeek-V3) normalizes the top-k sigmoid scores into the experts' weights."""

    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free load balancing (DeepSeek-V3): a per-expert bias added to the scores for the
    top-k choice only, moved after every optimizer step by ``moe_router_bias_update_rate`` toward
    the experts that got fewer tokens than the mean (over all data-parallel ranks). Needs
    ``moe_router_score_function: sigmoid``; the bias is saved in checkpoints."""

    moe_router_bias_update_rate: NonNegativeFloat = 1e-3
    """Step of the expert-bias update: bias += rate × sign(mean load − expert load)."""

    moe_per_layer_logging: bool = False
    """Also log each MoE layer's metrics (``moe/layer_<n>/...``), not only their means."""

    def validate(self, prefix: str) -> list[str]:
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            return [
                f"{prefix}.moe_router_enable_expert_bias needs {prefix}.moe_router_score_function: "
                f"sigmoid (got {self.moe_router_score_function})"
            ]
        return []
