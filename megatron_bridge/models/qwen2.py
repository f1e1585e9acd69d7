"""Qwen2 (and Qwen2.5): Llama layout with Q/K/V biases, which its config has no switch for."""

from megatron_bridge.family import ModelFamily
from megatron_bridge.models.common import (
    TINY_SHAPE,
    H,
    L,
    attention,
    decoder_facts,
    embeddings_and_head,
    from_max_window_layers,
    gated_mlp,
)
from megatron_bridge.registry import register

HF_DEFAULTS = {
    # transformers' Qwen2Config
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}
"""What a Qwen2 ``config.json`` that leaves out one of these keys means (``ModelFamily.hf_defaults``)."""

QWEN2 = register(
    ModelFamily(
        name="qwen2",
        model_types=("qwen2",),
        mappings=(*embeddings_and_head(), *attention(bias=True), *gated_mlp(L + "mlp.", H + "mlp.")),
        facts=decoder_facts(qkv_bias=True, window_layers=from_max_window_layers),
        tiny_preset={**TINY_SHAPE, "intermediate_size": 256, "rope_theta": 1e6, "tie_word_embeddings": True},
        hf_defaults=HF_DEFAULTS,
    )
)
