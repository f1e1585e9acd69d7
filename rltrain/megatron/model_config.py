"""Translation of a Hugging Face config into Megatron-Core's ``TransformerConfig`` and the
``GPTModel`` arguments outside it, for any registered model family.

Contract: ``transformer_config_from_hf(hf_config, parallel=..., params_dtype=...)`` and
``gpt_options(hf_config, role=...)`` read shapes from the HF config and what differs between
families (Q/K/V biases, q/k norm, tied embeddings, experts, router and shared expert, multi-latent
attention) from the family's ``ArchitectureFacts`` (``megatron_bridge/models/``); no code here
branches on ``model_type``. Bad layouts fail before any allocation, naming both numbers
(``tensor_model_parallel_size=3 does not divide num_attention_heads=4``); unsupported RoPE
variants and MoE or sliding windows under context parallelism are refused, naming the key;
sliding-window layers become Megatron's ``window_size`` / ``window_attn_skip_freq``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from megatron.core.transformer import MLATransformerConfig, TransformerConfig

from megatron_bridge.family import ArchitectureFacts, MoEFacts
from megatron_bridge.hf_config import config_value
from megatron_bridge.layout import layout_problems
from megatron_bridge.registry import get_family, supported_model_types
from rltrain.config.moe import MoEConfig
from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.parallel import last_stage_layers_for_megatron
from rltrain.megatron.yarn import gqa_transformer_config, mla_yarn_kwargs, yarn_settings

Role = Literal["actor", "reference", "critic", "reward"]
SCALAR_HEAD_ROLES = ("critic", "reward")
"""Roles whose ``output_layer`` is a :class:`ValueHead` (one number per token) instead of the LM head."""


@dataclass(frozen=True)
class GPTOptions:
    """``GPTModel`` constructor arguments that are not part of ``TransformerConfig``."""

    vocab_size: int
    max_sequence_length: int
    rotary_base: float
    rope_scaling: bool
    """Llama-3 style frequency scaling."""
    rope_scaling_factor: float
    seq_len_interpolation_factor: float | None
    """Linear RoPE scaling (``rope_type: linear``)."""
    tie_word_embeddings: bool
    position_embedding_type: str = "rope"
    """``"yarn"`` for YaRN with grouped-query attention (its settings ride on the TransformerConfig);
    multi-latent attention applies its own RoPE, YaRN included."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions RoPE rotates (``ArchitectureFacts.rotary_fraction``)."""


def architecture_facts(hf_config: Any) -> ArchitectureFacts:
    """What the model family of ``hf_config`` (``megatron_bridge/models/``) says about this model."""
    model_type = hf_config.model_type
    try:
        family = get_family(model_type)  # a recognized but refused type: NotImplementedError, its reason
    except KeyError:
        supported = supported_model_types()
        raise NotImplementedError(f"model_type={model_type!r}; supported: {', '.join(supported)}") from None
    return family.facts(hf_config)


def validate_layout(hf_config: Any, parallel: ParallelConfig, *, moe: MoEFacts | None) -> list[str]:
    """Problems of running ``hf_config`` (with experts ``moe``) at ``parallel``, each naming both numbers."""
    return layout_problems(
        hf_config,
        tp=parallel.tensor_model_parallel_size,
        pp=parallel.pipeline_model_parallel_size,
        vpp=parallel.virtual_pipeline_model_parallel_size or 1,
        ep=parallel.expert_model_parallel_size,
        etp=parallel.expert_tensor_parallel_size,
        moe=moe,
        first=parallel.num_layers_in_first_pipeline_stage,
        last=parallel.num_layers_in_last_pipeline_stage,
    )


def _kv_heads(hf_config: Any) -> int:
    return config_value(hf_config, "num_key_value_heads", default=hf_config.num_attention_heads)


def _rope(hf_config: Any) -> dict:
    params = dict(config_value(hf_config, "rope_parameters", "rope_scaling", default={}) or {})
    params.setdefault("rope_theta", config_value(hf_config, "rope_theta", default=10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def padded_vocab_size(vocab_size: int, *, tp_size: int, divisible_by: int = 1) -> int:
    """Smallest multiple of ``divisible_by × tp_size`` that holds ``vocab_size`` (Megatron's padding)."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def gpt_options(hf_config: Any, *, role: Role, vocab_size: int | None = None) -> GPTOptions:
    """The ``GPTModel`` arguments for ``hf_config`` (RoPE base and scaling, vocabulary, tying)."""
    facts = architecture_facts(hf_config)
    rope = _rope(hf_config)
    rope_type = rope["rope_type"]
    llama3 = rope_type == "llama3"
    if llama3:
        # Megatron hard-codes the other llama3 constants; refuse checkpoints that differ.
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        wrong = {k: rope.get(k) for k, v in expected.items() if float(rope.get(k, v)) != v}
        if wrong:
            raise NotImplementedError(
                f"rope_parameters {wrong} differ from Megatron's llama3 constants {expected}"
            )
    elif rope_type == "yarn":
        yarn_settings(hf_config, rope, mla=facts.mla is not None)  # refuses what Megatron cannot express
    elif rope_type not in ("default", "linear"):
        raise NotImplementedError(f"rope_type={rope_type!r} is not supported (default, linear, llama3, yarn)")
    return GPTOptions(
        vocab_size=vocab_size or hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        rotary_base=float(rope["rope_theta"]),
        rope_scaling=llama3,
        rope_scaling_factor=float(rope.get("factor") or 8.0),  # used by llama3 only
        seq_len_interpolation_factor=float(rope["factor"]) if rope_type == "linear" else None,
        tie_word_embeddings=facts.tie_word_embeddings and role not in SCALAR_HEAD_ROLES,
        position_embedding_type="yarn" if rope_type == "yarn" and not facts.mla else "rope",
        rotary_percent=_rotary_percent(facts, model_type=hf_config.model_type),
    )


def _rotary_percent(facts: ArchitectureFacts, *, model_type: str) -> float:
    """Megatron's ``rotary_percent``: RoPE on the first ``rotary_fraction`` of each head, rotate-half
    style (non-interleaved), the rest passed through; the rotary part must be whole frequency pairs."""
    if not 0.0 < facts.rotary_fraction <= 1.0:
        raise ValueError(f"{model_type}: partial_rotary_factor={facts.rotary_fraction} must be in (0, 1]")
    if facts.rotary_fraction != 1.0 and facts.mla:
        raise NotImplementedError(
            f"{model_type}: partial_rotary_factor with multi-latent attention is not supported"
        )
    return facts.rotary_fraction


def transformer_config_from_hf(
    hf_config: Any,
    *,
    parallel: ParallelConfig,
    params_dtype: torch.dtype,
    recompute_activations: bool = False,
    moe_options: MoEConfig | None = None,
) -> TransformerConfig:
    """``TransformerConfig`` for ``hf_config`` at layout ``parallel`` (with the router options
    ``moe_options``, ``model.moe``); raises on a bad layout."""
    model_type = hf_config.model_type
    facts = architecture_facts(hf_config)
    problems = validate_layout(hf_config, parallel, moe=facts.moe)
    if problems:
        raise ValueError(f"{model_type}: " + "; ".join(problems))
    if facts.sliding_layers and parallel.context_parallel_size > 1:
        raise NotImplementedError(
            f"{model_type}: sliding_window with parallel.context_parallel_size="
            f"{parallel.context_parallel_size} is not supported"
        )
    if facts.moe and parallel.context_parallel_size > 1:
        # The router's auxiliary loss would be computed per CP rank's tokens, not the sequence's.
        raise NotImplementedError(
            f"{model_type}: parallel.context_parallel_size={parallel.context_parallel_size} with MoE is not supported"
        )
    on_gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=_kv_heads(hf_config),
        kv_channels=config_value(
            hf_config, "head_dim", default=hf_config.hidden_size // hf_config.num_attention_heads
        ),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=facts.qkv_bias,
        qk_layernorm=facts.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=config_value(hf_config, "initializer_range", default=0.02),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        attention_softmax_in_fp32=True,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not on_gpu,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=parallel.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=last_stage_layers_for_megatron(parallel),
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size
        or parallel.tensor_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        # Micro-batches differ in length (dynamic batch size, packing): exchange shapes between stages.
        variable_seq_lengths=True,
        # Megatron refuses variable_seq_lengths with the (default) allgather dispatcher, even for dense models.
        moe_token_dispatcher_type="alltoall",
        # Interleaved PP with batched p2p gives wrong results (NVIDIA/Megatron-LM#750).
        batch_p2p_comm=parallel.virtual_pipeline_model_parallel_size is None,
        batch_p2p_sync=on_gpu,
    )
    kwargs.update(sliding_window_kwargs(facts, num_layers=hf_config.num_hidden_layers))
    kwargs.update(bias_sink_glu_kwargs(facts))
    if recompute_activations:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if facts.mtp_num_layers:
        # Megatron-Core's MultiTokenPredictionBlock (mtp.layers.*), built on the last stage
        kwargs["mtp_num_layers"] = facts.mtp_num_layers
    if facts.moe:
        kwargs.update(_moe_kwargs(facts.moe, model_type=model_type, num_layers=hf_config.num_hidden_layers))
        router = _router_option_kwargs(moe_options or MoEConfig())
        # A family whose checkpoints hold the expert bias (DeepSeek-V3) always has it.
        router["moe_router_enable_expert_bias"] = (
            router["moe_router_enable_expert_bias"] or facts.moe.expert_bias
        )
        kwargs.update(router)
    elif moe_options is not None and moe_options != MoEConfig():
        changed = [k for k, v in vars(moe_options).items() if v != getattr(MoEConfig(), k)]
        raise ValueError(f"model.moe.{changed[0]} is set but {model_type} has no experts")
    if facts.mla:
        mla = facts.mla
        rope = _rope(hf_config)
        if rope["rope_type"] not in ("default", "yarn"):
            # MLA applies its own RoPE; GPTModel's linear / llama3 scaling would not reach it.
            raise NotImplementedError(
                f"{model_type}: rope_parameters.rope_type={rope['rope_type']!r} with multi-latent attention "
                "is not supported (default, yarn)"
            )
        kwargs.update(
            q_lora_rank=mla.q_lora_rank,
            kv_lora_rank=mla.kv_lora_rank,
            qk_head_dim=mla.qk_nope_head_dim,
            qk_pos_emb_head_dim=mla.qk_rope_head_dim,
            v_head_dim=mla.v_head_dim,
            # The latent norms (HF's q_a_layernorm / kv_a_layernorm).
            qk_layernorm=True,
            # Plain RoPE on the rotary dims: scaling factor 1 makes Megatron's YaRN softmax mscale 1,
            # HF's 1/sqrt(qk_head_dim).
            rope_type="rope",
            rotary_base=float(rope["rope_theta"]),
            rotary_scaling_factor=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        )
        if rope["rope_type"] == "yarn":
            kwargs.update(mla_yarn_kwargs(yarn_settings(hf_config, rope, mla=True)))
        return MLATransformerConfig(**kwargs)
    rope = _rope(hf_config)
    if rope["rope_type"] == "yarn":
        return gqa_transformer_config(
            kwargs, yarn_settings(hf_config, rope, mla=False), model_type=model_type
        )
    return TransformerConfig(**kwargs)


def sliding_window_kwargs(facts: ArchitectureFacts, *, num_layers: int) -> dict[str, Any]:
    """Megatron's ``window_size`` / ``window_attn_skip_freq`` for the model's sliding-window layers.

    HF's window w lets query i see keys i - w + 1 .. i; Megatron's ``window_size=(left, right)``
    lets it see i - left .. i + right, so left = w - 1. ``window_attn_skip_freq`` as a list marks
    each layer (1 = sliding)."""
    if not facts.sliding_layers:
        return {}
    return dict(
        window_size=(facts.sliding_window - 1, 0),
        window_attn_skip_freq=[int(i in facts.sliding_layers) for i in range(num_layers)],
    )


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """Megatron-Core's ``quick_gelu`` (transformers' GPT-OSS gate with alpha 1.702), without the
    ``torch.compile`` Megatron wraps it in (the unfused GLU calls whatever ``activation_func`` is)."""
    return x * torch.sigmoid(1.702 * x)


def bias_sink_glu_kwargs(facts: ArchitectureFacts) -> dict[str, Any]:
    """Megatron's settings for biases on every linear (``add_bias_linear``: the router too), attention
    sinks (``softmax_type='learnable'``: ``core_attention.softmax_offset``) and GPT-OSS's clamped GLU:
    Megatron's unfused GLU is ``act(clamp(gate, max=c)) · (clamp(up, -c, c) + glu_linear_offset)``,
    with ``quick_gelu`` = ``x · sigmoid(1.702 x)``."""
    kwargs: dict[str, Any] = {}
    if facts.linear_bias:
        kwargs["add_bias_linear"] = True
    if facts.attention_sinks:
        kwargs["softmax_type"] = "learnable"
    if facts.clamped_glu_limit is not None:
        kwargs.update(
            activation_func=quick_gelu,
            glu_linear_offset=1.0,
            activation_func_clamp_value=facts.clamped_glu_limit,
        )
    return kwargs


def _router_option_kwargs(options: MoEConfig) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        moe_z_loss_coeff=options.moe_z_loss_coeff,
        moe_router_enable_expert_bias=options.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=options.moe_router_bias_update_rate,
        moe_per_layer_logging=options.moe_per_layer_logging,
    )
    if options.moe_router_score_function is not None:
        kwargs["moe_router_score_function"] = options.moe_router_score_function
    if options.moe_aux_loss_coeff is not None:
        kwargs["moe_aux_loss_coeff"] = options.moe_aux_loss_coeff
        kwargs["moe_router_load_balancing_type"] = "aux_loss" if options.moe_aux_loss_coeff else "none"
    return kwargs


def _moe_kwargs(moe: MoEFacts, *, model_type: str, num_layers: int) -> dict[str, Any]:
    if moe.dense_layers and not any(row.layers == "dense" for row in get_family(model_type).mappings):
        dense = list(moe.dense_layers)
        raise NotImplementedError(
            f"{model_type}: dense layers between MoE layers are not supported ({dense})"
        )
    kwargs: dict[str, Any] = dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_topk=moe.top_k,
        # Renormalized top-k probabilities equal a softmax over the top-k logits (Megatron's default);
        # keeping the full-softmax probabilities of the top k is Megatron's pre-softmax routing.
        moe_router_pre_softmax=not moe.renormalize_topk,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff else "none",
        moe_grouped_gemm=torch.cuda.is_available(),
        moe_router_dtype="fp32",
        # Routing replay (router_replay.mode): each router gets a RouterReplay; with no action set it
        # computes its top-k as usual.
        moe_enable_routing_replay=True,
        moe_router_score_function=moe.score_function,
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_router_topk_scaling_factor=moe.topk_scaling_factor,
        moe_router_enable_expert_bias=moe.expert_bias,
    )
    if moe.dense_layers:
        # Megatron's per-layer pattern: 1 = MoE layer, 0 = dense MLP (of ffn_hidden_size).
        kwargs["moe_layer_freq"] = [0 if i in moe.dense_layers else 1 for i in range(num_layers)]
    if moe.score_function == "sigmoid":
        kwargs["moe_router_pre_softmax"] = False
    if moe.shared_expert_ffn_hidden_size:
        kwargs.update(
            moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
            moe_shared_expert_gate=moe.shared_expert_gate,
        )
    return kwargs
