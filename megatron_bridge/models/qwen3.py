"""Qwen3: Llama layout with per-head RMSNorm on queries and keys (``q_norm``/``k_norm``), no biases."""

from megatron_bridge.family import ModelFamily
from megatron_bridge.models.common import (
    TINY_SHAPE,
    H,
    L,
    attention,
    decoder_facts,
    embeddings_and_head,
    gated_mlp,
)
from megatron_bridge.registry import register

QWEN3 = register(
    ModelFamily(
        name="qwen3",
        model_types=("qwen3",),
        mappings=(*embeddings_and_head(), *attention(qk_norm=True), *gated_mlp(L + "mlp.", H + "mlp.")),
        facts=decoder_facts(qk_norm=True),
        tiny_preset={
            **TINY_SHAPE,
            "intermediate_size": 256,
            "head_dim": 32,
            "rope_theta": 1e6,
            "tie_word_embeddings": True,
        },
    )
)
