"""Qwen2 (QKV biases), Qwen3 (per-head q/k RMSNorm, no biases), Qwen2-MoE and Qwen3-MoE.

Qwen2-MoE adds a shared expert with a sigmoid gate (``shared_expert_gate`` → Megatron's
``shared_experts.gate_weight``); Qwen3-MoE has no shared expert.
"""

from megatron_bridge.mappings import Replicated
from megatron_bridge.models.common import H, L, attention, embeddings_and_head, experts, gated_mlp
from megatron_bridge.registry import FamilyTable, register

QWEN2 = register(
    FamilyTable(
        name="qwen2",
        model_types=("qwen2",),
        mappings=(*embeddings_and_head(), *attention(bias=True), *gated_mlp(L + "mlp.", H + "mlp.")),
    )
)

QWEN3 = register(
    FamilyTable(
        name="qwen3",
        model_types=("qwen3",),
        mappings=(*embeddings_and_head(), *attention(qk_norm=True), *gated_mlp(L + "mlp.", H + "mlp.")),
    )
)

_ROUTED = (
    Replicated(L + "mlp.router.weight", H + "mlp.gate.weight"),
    *experts(
        hf_expert=H + "mlp.experts.*.", gate="gate_proj.weight", up="up_proj.weight", down="down_proj.weight"
    ),
)

QWEN2_MOE = register(
    FamilyTable(
        name="qwen2_moe",
        model_types=("qwen2_moe",),
        mappings=(
            *embeddings_and_head(),
            *attention(bias=True),
            *_ROUTED,
            *gated_mlp(L + "mlp.shared_experts.", H + "mlp.shared_expert."),
            Replicated(L + "mlp.shared_experts.gate_weight", H + "mlp.shared_expert_gate.weight"),
        ),
    )
)

QWEN3_MOE = register(
    FamilyTable(
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        mappings=(*embeddings_and_head(), *attention(qk_norm=True), *_ROUTED),
    )
)
