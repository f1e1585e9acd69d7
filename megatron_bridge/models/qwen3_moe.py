"""Qwen3-MoE: Qwen3 attention (q/k norms, no biases), routed experts, no shared expert.

Released checkpoints set ``norm_topk_prob`` (the top-k probabilities are renormalized).
"""

from megatron_bridge.family import ModelFamily
from megatron_bridge.models.common import (
    TINY_QWEN_EXPERTS,
    TINY_SHAPE,
    attention,
    decoder_facts,
    embeddings_and_head,
    qwen_routed_experts,
)
from megatron_bridge.registry import register

HF_DEFAULTS = {
    # transformers' Qwen3MoeConfig (Qwen3-30B-A3B's widths and experts in 24 layers, norm_topk_prob
    # false); mlp_only_layers None: none
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
    "decoder_sparse_step": 1,
    "mlp_only_layers": None,
    "use_sliding_window": False,
    "sliding_window": 4096,
}
"""What a Qwen3-MoE ``config.json`` that leaves out one of these keys means (``ModelFamily.hf_defaults``)."""

QWEN3_MOE = register(
    ModelFamily(
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        mappings=(*embeddings_and_head(), *attention(qk_norm=True), *qwen_routed_experts()),
        facts=decoder_facts(qk_norm=True, experts=True),
        tiny_preset={
            **TINY_SHAPE,
            **TINY_QWEN_EXPERTS,
            "head_dim": 32,
            "norm_topk_prob": True,
            "rope_theta": 1e6,
            "tie_word_embeddings": False,
        },
        hf_defaults=HF_DEFAULTS,
    )
)
