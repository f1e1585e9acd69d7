"""Mixtral: Llama attention, top-k routed SwiGLU experts named ``w1`` (gate), ``w3`` (up), ``w2`` (down).

The router renormalizes the top-k probabilities (a softmax over the chosen experts' logits).
"""

from megatron_bridge.family import ModelFamily
from megatron_bridge.models.common import (
    TINY_SHAPE,
    H,
    attention,
    decoder_facts,
    embeddings_and_head,
    routed_experts,
)
from megatron_bridge.registry import register

HF_DEFAULTS = {
    # transformers' MixtralConfig (Mixtral-8x7B); head_dim None: hidden / heads
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": None,
    "tie_word_embeddings": False,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
}
"""What a Mixtral ``config.json`` that leaves out one of these keys means (``ModelFamily.hf_defaults``)."""

MIXTRAL = register(
    ModelFamily(
        name="mixtral",
        model_types=("mixtral",),
        mappings=(
            *embeddings_and_head(),
            *attention(),
            *routed_experts(
                hf_router=H + "block_sparse_moe.gate.weight",
                hf_expert=H + "block_sparse_moe.experts.*.",
                gate="w1.weight",
                up="w3.weight",
                down="w2.weight",
            ),
        ),
        facts=decoder_facts(experts=True, renormalize_topk=True),
        tiny_preset={
            **TINY_SHAPE,
            "intermediate_size": 128,
            "rope_theta": 1e6,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.01,
            "tie_word_embeddings": False,
        },
        hf_defaults=HF_DEFAULTS,
    )
)
