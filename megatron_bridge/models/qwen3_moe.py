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
    )
)
