"""Pieces shared by the Llama-style families: mapping rows, readers of HF config facts, tiny shapes.

Contract: each row helper returns a tuple of mappings (canonical Megatron names, HF checkpoint
names); a family's table is the concatenation of the pieces it uses, so every row of every family
is visible here or in its own file. ``decoder_facts`` builds a family's facts reader, which takes an
HF config (``PretrainedConfig`` or a ``config.json`` dict) and reads only standard HF attribute names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from megatron_bridge.family import ArchitectureFacts, MoEFacts
from megatron_bridge.hf_config import config_value
from megatron_bridge.mappings import (
    QKV,
    AnyMapping,
    ColumnParallel,
    CopyOf,
    GatedMLP,
    GroupedExperts,
    PerExpert,
    Replicated,
    RowParallel,
    VocabParallel,
)

L = "decoder.layers.*."
H = "model.layers.*."

# The smallest shapes every backend accepts: vLLM's CPU attention needs a head size of 32 or more,
# Megatron at TP=2 needs heads and KV heads divisible by 2. Families add their own fields.
TINY_SHAPE: dict[str, Any] = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
# The experts of the tiny Qwen-MoE models.
TINY_QWEN_EXPERTS: dict[str, Any] = dict(
    intermediate_size=256,
    moe_intermediate_size=128,
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    router_aux_loss_coef=0.001,
)


def embeddings_and_head() -> tuple[AnyMapping, ...]:
    """Embedding, final norm and output layer (the output row is dropped for tied embeddings)."""
    return (
        VocabParallel("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        Replicated("decoder.final_layernorm.weight", "model.norm.weight"),
        VocabParallel("output_layer.weight", "lm_head.weight"),
    )


def attention(*, bias: bool = False, qk_norm: bool = False) -> tuple[AnyMapping, ...]:
    """Pre-attention norm, fused QKV (optionally with bias and per-head q/k norms), output projection."""
    rows: list[AnyMapping] = [
        Replicated(L + "input_layernorm.weight", H + "input_layernorm.weight"),
        QKV(
            L + "self_attention.linear_qkv.weight",
            H + "self_attn.q_proj.weight",
            k=H + "self_attn.k_proj.weight",
            v=H + "self_attn.v_proj.weight",
        ),
        RowParallel(L + "self_attention.linear_proj.weight", H + "self_attn.o_proj.weight"),
        Replicated(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight"),
    ]
    if bias:
        rows.append(
            QKV(
                L + "self_attention.linear_qkv.bias",
                H + "self_attn.q_proj.bias",
                k=H + "self_attn.k_proj.bias",
                v=H + "self_attn.v_proj.bias",
            )
        )
    if qk_norm:
        rows.append(Replicated(L + "self_attention.q_layernorm.weight", H + "self_attn.q_norm.weight"))
        rows.append(Replicated(L + "self_attention.k_layernorm.weight", H + "self_attn.k_norm.weight"))
    return tuple(rows)


def gated_mlp(megatron_prefix: str, hf_prefix: str) -> tuple[AnyMapping, ...]:
    """A SwiGLU MLP with HF names ``gate_proj``/``up_proj``/``down_proj`` under ``hf_prefix``."""
    return (
        GatedMLP(
            megatron_prefix + "linear_fc1.weight",
            hf_prefix + "gate_proj.weight",
            up=hf_prefix + "up_proj.weight",
        ),
        RowParallel(megatron_prefix + "linear_fc2.weight", hf_prefix + "down_proj.weight"),
    )


def routed_experts(
    *, hf_router: str, hf_expert: str, gate: str, up: str, down: str
) -> tuple[AnyMapping, ...]:
    """Router and per-expert SwiGLU tensors; ``hf_expert``: the HF prefix with (layer, expert) wildcards."""
    m = L + "mlp.experts.local_experts.*."
    return (
        Replicated(L + "mlp.router.weight", hf_router),
        PerExpert(GatedMLP(m + "linear_fc1.weight", hf_expert + gate, up=hf_expert + up)),
        PerExpert(RowParallel(m + "linear_fc2.weight", hf_expert + down)),
    )


def qwen_routed_experts() -> tuple[AnyMapping, ...]:
    """The router and experts of Qwen2-MoE and Qwen3-MoE (``mlp.gate``, ``mlp.experts.*.*_proj``)."""
    return routed_experts(
        hf_router=H + "mlp.gate.weight",
        hf_expert=H + "mlp.experts.*.",
        gate="gate_proj.weight",
        up="up_proj.weight",
        down="down_proj.weight",
    )


def mtp_layers(
    decoder_rows: tuple[AnyMapping, ...], *, embedding_copy: bool = True, head_copy: bool = True
) -> tuple[AnyMapping, ...]:
    """The rows of multi-token-prediction layers as DeepSeek-V3 and GLM-4.5 store them: HF decoder
    layer ``num_hidden_layers + i`` holds a whole decoder layer (the family's ``decoder_rows``, same
    HF names) plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``; Megatron-Core's
    ``mtp.layers.i`` holds them as ``enorm``, ``hnorm``, ``eh_proj``, ``final_layernorm`` and
    ``transformer_layer``. ``embedding_copy`` / ``head_copy``: the checkpoint also stores the
    layer's own ``embed_tokens`` / ``shared_head.head``, which Megatron shares with the main model
    (``CopyOf``: checked equal on import, written back on export)."""
    m = "mtp.layers.*."

    def inner(row: AnyMapping) -> AnyMapping:
        if isinstance(row, PerExpert | GroupedExperts):
            return replace(row, inner=inner(row.inner))
        return replace(row, megatron=m + "transformer_layer." + row.megatron.removeprefix(L))

    rows: list[AnyMapping] = [inner(row) for row in decoder_rows if row.megatron.startswith(L)]
    rows += [
        Replicated(m + "enorm.weight", H + "enorm.weight"),
        Replicated(m + "hnorm.weight", H + "hnorm.weight"),
        ColumnParallel(m + "eh_proj.weight", H + "eh_proj.weight"),
        Replicated(m + "final_layernorm.weight", H + "shared_head.norm.weight"),
    ]
    if embedding_copy:
        rows.append(CopyOf("embedding.word_embeddings.weight", H + "embed_tokens.weight"))
    if head_copy:
        rows.append(CopyOf("output_layer.weight", H + "shared_head.head.weight"))
    return tuple(rows)


# ---- architecture facts ------------------------------------------------------------------------
def every_layer(config: Any, num_layers: int) -> list[bool]:
    """Sliding-window layers of a config without ``layer_types`` (Mistral, Mixtral, Qwen3-MoE): all."""
    return [True] * num_layers


def from_max_window_layers(config: Any, num_layers: int) -> list[bool]:
    """Qwen2/Qwen3 (transformers' ``Qwen2Config``): layers from ``max_window_layers`` on slide."""
    first = config_value(config, "max_window_layers", default=num_layers)
    return [i >= first for i in range(num_layers)]


def odd_below_max_window_layers(config: Any, num_layers: int) -> list[bool]:
    """Qwen2-MoE (transformers' ``Qwen2MoeConfig``): every other layer (0, 2, ...) below
    ``max_window_layers`` slides."""
    last = config_value(config, "max_window_layers", default=num_layers)
    return [i % 2 == 0 and i < last for i in range(num_layers)]


def sliding_window_facts(
    config: Any, default_layers: Callable[[Any, int], list[bool]]
) -> tuple[int | None, tuple[int, ...]]:
    """(window, sliding layer numbers) as transformers reads them: nothing unless
    ``use_sliding_window`` (where the family has it) and ``sliding_window`` are set; then the
    layers ``layer_types`` marks ``sliding_attention``, or, without ``layer_types``, the
    family's rule ``default_layers`` (transformers' derivation for its config class)."""
    window = config_value(config, "sliding_window")
    if not window or not config_value(config, "use_sliding_window", default=True):
        return None, ()
    num_layers = config_value(config, "num_hidden_layers")
    layer_types = config_value(config, "layer_types")
    if layer_types is None:
        sliding = default_layers(config, num_layers)
    else:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown or len(layer_types) != num_layers:
            raise NotImplementedError(
                f"layer_types {unknown or layer_types} is not supported (one of full_attention / "
                f"sliding_attention per layer, {num_layers} layers)"
            )
        sliding = [kind == "sliding_attention" for kind in layer_types]
    layers = tuple(i for i, slides in enumerate(sliding) if slides)
    return (int(window) if layers else None), layers


def decoder_facts(
    *,
    qkv_bias: bool | None = None,
    qk_norm: bool = False,
    experts: bool = False,
    renormalize_topk: bool | None = None,
    shared_expert: bool = False,
    window_layers: Callable[[Any, int], list[bool]] = every_layer,
) -> Callable[[Any], ArchitectureFacts]:
    """The facts reader of a Llama-style decoder family; each ``None`` is read from the config.

    ``qkv_bias``: from ``qkv_bias`` / ``attention_bias`` (default none). ``experts``: the family routes
    tokens to experts when the config sets ``num_local_experts`` / ``num_experts``;
    ``renormalize_topk``: from ``norm_topk_prob`` (default off); ``shared_expert``: a sigmoid-gated
    shared expert of ``shared_expert_intermediate_size`` (Qwen2-MoE). Tied embeddings always come
    from ``tie_word_embeddings``; sliding-window attention from ``sliding_window_facts`` with the
    family's ``window_layers`` rule for configs without ``layer_types``.
    """

    def facts(config: Any) -> ArchitectureFacts:
        window, layers = sliding_window_facts(config, window_layers)
        bias = (
            config_value(config, "qkv_bias", "attention_bias", default=False)
            if qkv_bias is None
            else qkv_bias
        )
        return ArchitectureFacts(
            qkv_bias=bool(bias),
            qk_norm=qk_norm,
            tie_word_embeddings=bool(config_value(config, "tie_word_embeddings", default=False)),
            moe=_moe_facts(config, renormalize_topk=renormalize_topk, shared_expert=shared_expert)
            if experts
            else None,
            sliding_window=window,
            sliding_layers=layers,
        )

    return facts


def _moe_facts(config: Any, *, renormalize_topk: bool | None, shared_expert: bool) -> MoEFacts | None:
    num_experts = config_value(config, "num_local_experts", "num_experts")
    if not num_experts:
        return None
    if renormalize_topk is None:
        renormalize_topk = bool(config_value(config, "norm_topk_prob", default=False))
    shared = config_value(config, "shared_expert_intermediate_size", default=0) if shared_expert else 0
    return MoEFacts(
        num_experts=num_experts,
        top_k=config_value(config, "num_experts_per_tok"),
        ffn_hidden_size=config_value(config, "moe_intermediate_size", "intermediate_size"),
        renormalize_topk=renormalize_topk,
        aux_loss_coeff=float(config_value(config, "router_aux_loss_coef", default=0.0)),
        shared_expert_ffn_hidden_size=shared,
        shared_expert_gate=bool(shared),
        dense_layers=dense_layers(config),
    )


def dense_layers(config: Any) -> tuple[int, ...]:
    """Layers with a dense MLP in a Qwen-MoE-style config: those in ``mlp_only_layers`` and, with
    ``decoder_sparse_step=s``, every layer ``i`` with ``(i + 1) % s != 0`` (HF's rule)."""
    mlp_only = config_value(config, "mlp_only_layers", default=[])
    step = config_value(config, "decoder_sparse_step", default=1)
    if step < 1:
        raise ValueError(f"decoder_sparse_step={step} must be at least 1")
    num_layers = config_value(config, "num_hidden_layers")
    return tuple(sorted(set(mlp_only) | {i for i in range(num_layers) if (i + 1) % step}))
