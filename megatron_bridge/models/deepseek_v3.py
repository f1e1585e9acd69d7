"""DeepSeek-V3: multi-latent attention, sigmoid-scored group-limited routing with an expert bias, a
shared expert, and dense MLPs in the first ``first_k_dense_replace`` layers.

Attention (MLA): ``q_a_proj`` → ``q_a_layernorm`` → ``q_b_proj`` for queries; ``kv_a_proj_with_mqa``
gives the key/value latent and the RoPE key shared by all heads, ``kv_a_layernorm`` →
``kv_b_proj`` the per-head keys (without RoPE) and values. Megatron's ``MLASelfAttention`` has the
same layout (``linear_q_down_proj``, ``linear_q_up_proj``, ``linear_kv_down_proj``,
``linear_kv_up_proj``), so every row is a 1:1 rename; the down projections are column-parallel in
Megatron's local spec (gathered before use), the up projections split by heads. Without a query
latent (``q_lora_rank: null``, DeepSeek-V2-Lite) queries come from one ``q_proj``, Megatron's
``linear_q_proj``, split by heads (the rows' ``query`` kind picks the layout).

Routing: ``sigmoid(logits) + e_score_correction_bias`` chooses the groups (sum of each group's top-2
scores) and then the experts; the chosen experts' unbiased scores are renormalized and multiplied
by ``routed_scaling_factor``. That is Megatron's sigmoid router with ``expert_bias`` when top-k over
the chosen groups is 2 per group, or when there is one group (Kimi-K2: ungrouped); configs Megatron
computes differently are refused by name.

Kimi-K2 (``model_type: kimi_k2``) is this family: its ``config.json`` names DeepSeek-V3's
architecture and remote-code config class, and reads as transformers' ``DeepseekV3Config``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_bridge.family import ArchitectureFacts, MLAFacts, ModelFamily, MoEFacts
from megatron_bridge.hf_config import config_value
from megatron_bridge.mappings import AnyMapping, ColumnParallel, Replicated, RowParallel
from megatron_bridge.models.common import (
    H,
    L,
    embeddings_and_head,
    gated_mlp,
    mtp_layers,
    routed_experts,
)
from megatron_bridge.registry import register

TINY_MLA = {
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
}
"""The attention and MLP sizes of the DeepSeek families' tiny presets (hidden size 64)."""


def mla_attention() -> tuple[AnyMapping, ...]:
    """Norms around the attention and the MLA projections: queries through a latent (``q_lora_rank``
    set) or one projection split by heads (``q_lora_rank: null``, DeepSeek-V2-Lite)."""
    a, s = L + "self_attention.", H + "self_attn."
    return (
        Replicated(L + "input_layernorm.weight", H + "input_layernorm.weight"),
        ColumnParallel(a + "linear_q_down_proj.weight", s + "q_a_proj.weight", query="latent"),
        Replicated(a + "q_layernorm.weight", s + "q_a_layernorm.weight", query="latent"),
        ColumnParallel(a + "linear_q_up_proj.weight", s + "q_b_proj.weight", query="latent"),
        ColumnParallel(a + "linear_q_proj.weight", s + "q_proj.weight", query="direct"),
        ColumnParallel(a + "linear_kv_down_proj.weight", s + "kv_a_proj_with_mqa.weight"),
        Replicated(a + "kv_layernorm.weight", s + "kv_a_layernorm.weight"),
        ColumnParallel(a + "linear_kv_up_proj.weight", s + "kv_b_proj.weight"),
        RowParallel(a + "linear_proj.weight", s + "o_proj.weight"),
        Replicated(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight"),
    )


def deepseek_moe(*, expert_bias: bool = True) -> tuple[AnyMapping, ...]:
    """Dense MLP rows (first layers), and router, expert bias (DeepSeek-V3; not V2), experts and
    shared expert (MoE layers)."""
    experts = routed_experts(
        hf_router=H + "mlp.gate.weight",
        hf_expert=H + "mlp.experts.*.",
        gate="gate_proj.weight",
        up="up_proj.weight",
        down="down_proj.weight",
    )
    bias = Replicated(L + "mlp.router.expert_bias", H + "mlp.gate.e_score_correction_bias", layers="moe")
    return (
        *(replace(row, layers="dense") for row in gated_mlp(L + "mlp.", H + "mlp.")),
        *(replace(row, layers="moe") if not row.is_expert else row for row in experts),
        *((bias,) if expert_bias else ()),
        *(
            replace(row, layers="moe")
            for row in gated_mlp(L + "mlp.shared_experts.", H + "mlp.shared_experts.")
        ),
    )


def mla_facts(config: Any, name: str) -> MLAFacts:
    """The attention of a DeepSeek-V2/V3 config ``name``; raises ``NotImplementedError`` naming the
    key Megatron's MLA cannot match."""
    get = lambda *names, default=None: config_value(config, *names, default=default)  # noqa: E731
    if get("attention_bias"):
        raise NotImplementedError(f"{name}: attention_bias=true is not supported")
    if not get("rope_interleave", default=True):
        raise NotImplementedError(
            f"{name}: rope_interleave=false is not supported (Megatron's MLA interleaves)"
        )
    return MLAFacts(
        q_lora_rank=get("q_lora_rank"),
        kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim"),
        qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"),
        # HF's q_a_layernorm / kv_a_layernorm keep their class default whatever rms_norm_eps says
        latent_norm_eps=1e-6,
    )


def deepseek_facts(config: Any) -> ArchitectureFacts:
    """Facts of a DeepSeek-V3 config; raises ``NotImplementedError`` naming the key Megatron cannot match."""
    get = lambda *names, default=None: config_value(config, *names, default=default)  # noqa: E731
    groups, group_topk = sigmoid_group_routing(config, "deepseek_v3")
    for key, routing in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if get(key, default=routing) != routing:
            # transformers' DeepseekV3 (and Megatron here) always route so; vLLM follows the key
            raise NotImplementedError(f"deepseek_v3: {key}={get(key)!r} is not supported (only {routing!r})")
    return deepseek_architecture(
        config,
        "deepseek_v3",
        renormalize_topk=True,
        score_function="sigmoid",
        num_groups=groups,
        group_topk=group_topk,
        expert_bias=True,
    )


def sigmoid_group_routing(config: Any, name: str) -> tuple[int | None, int | None]:
    """Megatron's ``(num_groups, group_topk)`` for a config ``name`` routing as DeepSeek-V3 does
    (sigmoid scores, renormalized top-k, ``n_group``/``topk_group``); raises ``NotImplementedError``
    naming the key Megatron cannot match.

    A single group (``n_group: 1``, Kimi-K2, GLM-4.5) is no grouping: HF's mask keeps the one group,
    so every expert competes, which is Megatron's ungrouped router (``(None, None)``).
    """
    get = lambda *names, default=None: config_value(config, *names, default=default)  # noqa: E731
    top_k = get("num_experts_per_tok")
    groups, group_topk = get("n_group"), get("topk_group")
    if not get("norm_topk_prob") and top_k > 1:
        raise NotImplementedError(
            f"{name}: norm_topk_prob=false is not supported (Megatron's sigmoid router renormalizes)"
        )
    if groups == 1:
        if group_topk != 1:
            raise ValueError(f"{name}: topk_group={group_topk} exceeds n_group=1")
        return None, None
    if top_k % group_topk or top_k // group_topk != 2:
        # HF scores a group by its top-2 experts; Megatron by its top (num_experts_per_tok / topk_group).
        raise NotImplementedError(
            f"{name}: num_experts_per_tok={top_k} / topk_group={group_topk} must be 2 "
            "(HF ranks groups by their top-2 experts, Megatron by their top num_experts_per_tok/topk_group)"
        )
    return groups, group_topk


def deepseek_moe_facts(
    config: Any,
    *,
    renormalize_topk: bool,
    score_function: str,
    num_groups: int | None,
    group_topk: int | None,
    expert_bias: bool,
) -> MoEFacts:
    """DeepSeek's MoE (also GLM-4.5's) with the given routing: routed experts of
    ``moe_intermediate_size``, a shared expert of ``n_shared_experts`` times that, the first
    ``first_k_dense_replace`` layers dense, ``routed_scaling_factor``, no auxiliary loss."""
    get = lambda *names, default=None: config_value(config, *names, default=default)  # noqa: E731
    moe_ffn = get("moe_intermediate_size")
    return MoEFacts(
        num_experts=get("n_routed_experts", "num_local_experts"),
        top_k=get("num_experts_per_tok"),
        ffn_hidden_size=moe_ffn,
        renormalize_topk=renormalize_topk,
        aux_loss_coeff=0.0,
        shared_expert_ffn_hidden_size=moe_ffn * get("n_shared_experts"),
        dense_layers=tuple(range(get("first_k_dense_replace"))),
        score_function=score_function,
        num_groups=num_groups,
        group_topk=group_topk,
        topk_scaling_factor=float(get("routed_scaling_factor")),
        expert_bias=expert_bias,
    )


def deepseek_architecture(
    config: Any,
    name: str,
    *,
    renormalize_topk: bool,
    score_function: str,
    num_groups: int | None,
    group_topk: int | None,
    expert_bias: bool,
) -> ArchitectureFacts:
    """The facts of a DeepSeek-V2/V3 config ``name`` with its family's routing: MLA attention, routed
    and shared experts, the first ``first_k_dense_replace`` layers dense, no auxiliary loss."""
    get = lambda *names, default=None: config_value(config, *names, default=default)  # noqa: E731
    return ArchitectureFacts(
        qkv_bias=False,
        qk_norm=False,
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        moe=deepseek_moe_facts(
            config,
            renormalize_topk=renormalize_topk,
            score_function=score_function,
            num_groups=num_groups,
            group_topk=group_topk,
            expert_bias=expert_bias,
        ),
        mla=mla_facts(config, name),
        mtp_num_layers=int(get("num_nextn_predict_layers", "num_mtp_layers", default=0)),
    )


HF_DEFAULTS = {
    # transformers' DeepseekV3Config (DeepSeek-V3, 671B), which has no scoring_func / topk_method keys
    # (it always routes by sigmoid with noaux_tc) and derives head_dim from qk_rope_head_dim
    "vocab_size": 129280,
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "rope_interleave": True,
    "tie_word_embeddings": False,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "moe_intermediate_size": 2048,
    "first_k_dense_replace": 3,
    # the config.json key is num_nextn_predict_layers (transformers' attribute_map)
    "num_mtp_layers": 1,
}
"""What a DeepSeek-V3 ``config.json`` that leaves out one of these keys means (``ModelFamily.hf_defaults``)."""

DEEPSEEK_V3 = register(
    ModelFamily(
        name="deepseek_v3",
        # Kimi-K2's config.json says model_type kimi_k2 (its own remote-code config class) for
        # DeepSeek-V3's architecture; vLLM and transformers' DeepseekV3Config read it unchanged.
        model_types=("deepseek_v3", "kimi_k2"),
        mappings=(
            *embeddings_and_head(),
            *mla_attention(),
            *deepseek_moe(),
            # the released checkpoints' layer 61 (num_nextn_predict_layers: 1)
            *mtp_layers((*mla_attention(), *deepseek_moe())),
        ),
        facts=deepseek_facts,
        tiny_preset={
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "first_k_dense_replace": 2,
            **TINY_MLA,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            # DeepSeek-V3's released config.json keys that vLLM reads (transformers assumes them):
            # without them vLLM routes by softmax and builds no expert-bias parameter.
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "num_mtp_layers": 0,
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": False,
        },
        hf_defaults=HF_DEFAULTS,
    )
)
