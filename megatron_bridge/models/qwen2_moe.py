"""Qwen2-MoE (Qwen1.5-MoE): Qwen2 attention (Q/K/V biases), routed experts plus a shared expert.

The router keeps each chosen expert's full-softmax probability unless ``norm_topk_prob``; the shared
expert's output is scaled by a sigmoid gate (``shared_expert_gate`` → Megatron's
``shared_experts.gate_weight``).
"""

from megatron_bridge.family import ModelFamily
from megatron_bridge.mappings import Replicated
from megatron_bridge.models.common import (
    TINY_QWEN_EXPERTS,
    TINY_SHAPE,
    H,
    L,
    attention,
    decoder_facts,
    embeddings_and_head,
    gated_mlp,
    odd_below_max_window_layers,
    qwen_routed_experts,
)
from megatron_bridge.registry import register

HF_DEFAULTS = {
    # transformers' Qwen2MoeConfig (Qwen1.5-MoE-A2.7B); mlp_only_layers None: none
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "qkv_bias": True,
    "tie_word_embeddings": False,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
    "decoder_sparse_step": 1,
    "mlp_only_layers": None,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}
"""What a Qwen2-MoE ``config.json`` that leaves out one of these keys means (``ModelFamily.hf_defaults``)."""

QWEN2_MOE = register(
    ModelFamily(
        name="qwen2_moe",
        model_types=("qwen2_moe",),
        mappings=(
            *embeddings_and_head(),
            *attention(bias=True),
            *qwen_routed_experts(),
            *gated_mlp(L + "mlp.shared_experts.", H + "mlp.shared_expert."),
            Replicated(L + "mlp.shared_experts.gate_weight", H + "mlp.shared_expert_gate.weight"),
        ),
        facts=decoder_facts(experts=True, shared_expert=True, window_layers=odd_below_max_window_layers),
        tiny_preset={
            **TINY_SHAPE,
            **TINY_QWEN_EXPERTS,
            "shared_expert_intermediate_size": 128,
            "norm_topk_prob": False,
            "rope_theta": 1e6,
            "tie_word_embeddings": False,
        },
        hf_defaults=HF_DEFAULTS,
    )
)
