"""Llama (and SmolLM2, which is a Llama): RMSNorm, GQA attention without biases, SwiGLU MLP."""

from megatron_bridge.models.common import H, L, attention, embeddings_and_head, gated_mlp
from megatron_bridge.registry import FamilyTable, register

LLAMA = register(
    FamilyTable(
        name="llama",
        model_types=("llama",),
        mappings=(*embeddings_and_head(), *attention(), *gated_mlp(L + "mlp.", H + "mlp.")),
    )
)
