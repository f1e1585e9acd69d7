"""Mixtral: Llama attention, top-k routed SwiGLU experts named ``w1`` (gate), ``w3`` (up), ``w2`` (down)."""

from megatron_bridge.mappings import Replicated
from megatron_bridge.models.common import H, L, attention, embeddings_and_head, experts
from megatron_bridge.registry import FamilyTable, register

MIXTRAL = register(
    FamilyTable(
        name="mixtral",
        model_types=("mixtral",),
        mappings=(
            *embeddings_and_head(),
            *attention(),
            Replicated(L + "mlp.router.weight", H + "block_sparse_moe.gate.weight"),
            *experts(
                hf_expert=H + "block_sparse_moe.experts.*.",
                gate="w1.weight",
                up="w3.weight",
                down="w2.weight",
            ),
        ),
    )
)
