"""DeepSeek-V2: DeepSeek-V3's layout (multi-latent attention, routed plus shared experts, dense MLPs
in the first ``first_k_dense_replace`` layers) with softmax routing and no expert bias.

Routing (transformers' ``DeepseekV2TopkRouter``): softmax over all experts; ``topk_method: greedy``
takes the top k, ``group_limited_greedy`` first keeps the ``topk_group`` groups whose best expert
scores highest; the chosen experts keep their softmax probabilities (never renormalized) times
``routed_scaling_factor``. That is Megatron's softmax router with pre-softmax top-k and the scaling
factor; Megatron scores a group by the sum of its top ``num_experts_per_tok / topk_group`` experts,
which is HF's best expert only when ``num_experts_per_tok == topk_group``, so other group-limited
configs are refused by name (as are V3's sigmoid, the expert bias, and ``norm_topk_prob: true``,
which vLLM honours and transformers ignores). The attention is V3's (``deepseek_v3.mla_facts``,
its refusals included). HF's auxiliary loss is not part of its forward; training starts without
one (``aux_loss_coeff`` 0), as for V3.
"""

from __future__ import annotations

from typing import Any

from megatron_bridge.family import ArchitectureFacts, ModelFamily
from megatron_bridge.hf_config import config_value
from megatron_bridge.models.common import embeddings_and_head
from megatron_bridge.models.deepseek_v3 import TINY_MLA, deepseek_architecture, deepseek_moe, mla_attention
from megatron_bridge.registry import register


def deepseek_v2_facts(config: Any) -> ArchitectureFacts:
    """Facts of a DeepSeek-V2 config; raises ``NotImplementedError`` naming the key Megatron cannot match."""
    get = lambda *names, default=None: config_value(config, *names, default=default)  # noqa: E731
    top_k = get("num_experts_per_tok")
    method = get("topk_method")
    if method == "greedy":
        groups, group_topk = None, None
    elif method == "group_limited_greedy":
        groups, group_topk = get("n_group"), get("topk_group")
        if top_k != group_topk:
            raise NotImplementedError(
                f"deepseek_v2: topk_method='group_limited_greedy' with num_experts_per_tok={top_k} != "
                f"topk_group={group_topk} (HF ranks groups by their best expert, Megatron by the sum of "
                "their top num_experts_per_tok/topk_group)"
            )
    else:
        raise NotImplementedError(
            f"deepseek_v2: topk_method={method!r} is not supported (greedy or group_limited_greedy)"
        )
    if get("scoring_func", default="softmax") != "softmax":
        raise NotImplementedError(
            f"deepseek_v2: scoring_func={get('scoring_func')!r} is not supported (softmax)"
        )
    if get("norm_topk_prob"):
        raise NotImplementedError(
            "deepseek_v2: norm_topk_prob=true is not supported (transformers' DeepseekV2 never "
            "renormalizes the top-k probabilities; vLLM would)"
        )
    return deepseek_architecture(
        config,
        "deepseek_v2",
        renormalize_topk=False,
        score_function="softmax",
        num_groups=groups,
        group_topk=group_topk,
        expert_bias=False,
    )


HF_DEFAULTS = {
    # transformers' DeepseekV2Config (64 experts and no top-k: released configs set it); None:
    # derived (KV heads = heads) or unset. It has no scoring_func key (softmax) and derives head_dim
    # from qk_rope_head_dim
    "vocab_size": 102400,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": None,
    "topk_method": "greedy",
    "n_group": None,
    "topk_group": None,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "moe_intermediate_size": 1407,
    "first_k_dense_replace": 0,
}
"""What a DeepSeek-V2 ``config.json`` that leaves out one of these keys means (``ModelFamily.hf_defaults``)."""

DEEPSEEK_V2 = register(
    ModelFamily(
        name="deepseek_v2",
        model_types=("deepseek_v2",),
        mappings=(*embeddings_and_head(), *mla_attention(), *deepseek_moe(expert_bias=False)),
        facts=deepseek_v2_facts,
        tiny_preset={
            "hidden_size": 64,
            # one dense layer and two MoE layers: at PP=2 the stages are uneven
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,
            **TINY_MLA,
            # three groups of two experts, two groups kept: the group limit decides
            "n_routed_experts": 6,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "topk_method": "group_limited_greedy",
            "n_group": 3,
            "topk_group": 2,
            "norm_topk_prob": False,
            "routed_scaling_factor": 2.0,
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": False,
        },
        hf_defaults=HF_DEFAULTS,
    )
)
