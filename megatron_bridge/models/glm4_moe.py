"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (``glm4_moe``): grouped-query attention with Q/K/V biases and
optional per-head q/k norms, RoPE on the first half of each head, and DeepSeek-V3's MoE.

Attention: ``q_proj``/``k_proj``/``v_proj`` (with biases when ``attention_bias``, as in every
released GLM-4.5: rows that exist only then, ``switch``), ``o_proj`` without; ``use_qk_norm`` (GLM-4.5, GLM-4.6; not GLM-4.5-Air) adds per-head RMSNorms on queries and
keys before RoPE, rows that exist only then (``switch``). RoPE rotates the first
``partial_rotary_factor × head_dim`` dimensions of each head rotate-half style (transformers'
``apply_rotary_pos_emb`` splits ``q[..., :rotary_dim]`` and rotates its halves) and passes the rest
through: Megatron's ``rotary_percent`` with non-interleaved RoPE, the same inverse frequencies
(``base ** (-arange(0, dim, 2) / dim)`` over the rotary ``dim``).

MLP: the first ``first_k_dense_replace`` layers dense, then routed experts with a shared expert of
``n_shared_experts × moe_intermediate_size``, routed as DeepSeek-V3 routes (sigmoid scores,
``e_score_correction_bias`` for the choice only, renormalized top-k times
``routed_scaling_factor``; ``n_group: 1`` is no grouping): the DeepSeek-V3 MoE rows, 1:1 renames.

Multi-token prediction: a checkpoint with ``num_nextn_predict_layers > 0`` (every released GLM-4.5)
holds its MTP layer as ``model.layers.<num_hidden_layers>.*``: a whole decoder layer (the rows
above), ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and its own ``embed_tokens`` copy, but
no ``shared_head.head`` (GLM-4.5-Air's module list has ``model.layers.46.embed_tokens`` and no head;
vLLM's GLM MTP model loads the main ``lm_head`` as its head): ``mtp_layers(..., head_copy=False)``.
transformers drops those tensors on load; the bridge maps them to Megatron-Core's ``mtp.layers.*``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_bridge.family import ArchitectureFacts, ModelFamily
from megatron_bridge.hf_config import config_value
from megatron_bridge.mappings import AnyMapping, Replicated
from megatron_bridge.models.common import TINY_SHAPE, H, L, attention, embeddings_and_head, mtp_layers
from megatron_bridge.models.deepseek_v3 import deepseek_moe, deepseek_moe_facts, sigmoid_group_routing
from megatron_bridge.registry import register


def glm4_moe_attention() -> tuple[AnyMapping, ...]:
    """Norms, fused QKV, output projection, and the Q/K/V biases and q/k norms that ``attention_bias``
    and ``use_qk_norm`` switch on."""
    unbiased = attention()
    (bias,) = [row for row in attention(bias=True) if row not in unbiased]
    return (
        *unbiased,
        replace(bias, switch="attention_bias"),
        Replicated(
            L + "self_attention.q_layernorm.weight", H + "self_attn.q_norm.weight", switch="use_qk_norm"
        ),
        Replicated(
            L + "self_attention.k_layernorm.weight", H + "self_attn.k_norm.weight", switch="use_qk_norm"
        ),
    )


def rotary_fraction(config: Any) -> float:
    """``partial_rotary_factor``, where transformers 5 keeps it (``rope_parameters``) or the file does."""
    rope = config_value(config, "rope_parameters", default=None) or {}
    # Glm4MoeConfig's __post_init__ sets 0.5 where the file leaves it out (it is no field of the class)
    return float(
        rope.get("partial_rotary_factor") or config_value(config, "partial_rotary_factor", default=0.5)
    )


def glm4_moe_facts(config: Any) -> ArchitectureFacts:
    """Facts of a GLM-4.5 config; raises ``NotImplementedError`` naming the key Megatron cannot match."""
    get = lambda *names, default=None: config_value(config, *names, default=default)  # noqa: E731
    groups, group_topk = sigmoid_group_routing(config, "glm4_moe")
    return ArchitectureFacts(
        qkv_bias=bool(get("attention_bias")),
        qk_norm=bool(get("use_qk_norm")),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        moe=deepseek_moe_facts(
            config,
            renormalize_topk=True,
            score_function="sigmoid",
            num_groups=groups,
            group_topk=group_topk,
            expert_bias=True,
        ),
        rotary_fraction=rotary_fraction(config),
        mtp_num_layers=int(get("num_nextn_predict_layers", "num_mtp_layers", default=0)),
    )


HF_DEFAULTS = {
    # transformers' Glm4MoeConfig (GLM-4.5-Air's shapes, but attention_bias false); head_dim and
    # partial_rotary_factor are no fields (hidden_size // num_attention_heads and 0.5 when left out)
    "vocab_size": 151552,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "num_hidden_layers": 46,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "moe_intermediate_size": 1408,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_routed_experts": 128,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "use_qk_norm": False,
    # None: __post_init__ builds it from rope_theta and partial_rotary_factor (read on their own)
    "rope_parameters": None,
    # the config.json key is num_nextn_predict_layers (transformers' attribute_map)
    "num_mtp_layers": 1,
}
"""What a GLM-4.5 ``config.json`` that leaves out one of these keys means (``ModelFamily.hf_defaults``)."""

GLM4_MOE = register(
    ModelFamily(
        name="glm4_moe",
        model_types=("glm4_moe",),
        mappings=(
            *embeddings_and_head(),
            *glm4_moe_attention(),
            *deepseek_moe(),
            # the released checkpoints' layer 46 (GLM-4.5-Air) / 92 (GLM-4.5): num_nextn_predict_layers 1
            *mtp_layers((*glm4_moe_attention(), *deepseek_moe()), head_copy=False),
        ),
        facts=glm4_moe_facts,
        tiny_preset={
            **TINY_SHAPE,
            "num_hidden_layers": 3,
            "head_dim": 32,
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "first_k_dense_replace": 1,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "attention_bias": True,
            "use_qk_norm": True,
            "partial_rotary_factor": 0.5,
            "num_nextn_predict_layers": 0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "tie_word_embeddings": False,
        },
        hf_defaults=HF_DEFAULTS,
    )
)
