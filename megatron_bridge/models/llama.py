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

HF_DEFAULTS = {
    # transformers' LlamaConfig; None: derived (KV heads = heads, head_dim = hidden / heads)
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "attention_bias": False,
    "tie_word_embeddings": False,
}
"""What a Llama ``config.json`` that leaves out one of these keys means (``ModelFamily.hf_defaults``)."""

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
        hf_defaults=HF_DEFAULTS,
    )
)
