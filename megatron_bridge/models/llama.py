"""Llama (and SmolLM2, which is a Llama): RMSNorm, GQA attention without biases, SwiGLU MLP."""

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

LLAMA = register(
    ModelFamily(
        name="llama",
        model_types=("llama",),
        mappings=(*embeddings_and_head(), *attention(), *gated_mlp(L + "mlp.", H + "mlp.")),
        facts=decoder_facts(),
        tiny_preset={
            **TINY_SHAPE,
            "intermediate_size": 256,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        },
    )
)
