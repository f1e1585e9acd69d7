"""GPT-OSS (``gpt_oss``; gpt-oss-20b, gpt-oss-120b): grouped-query attention with biases on every
projection and a learned sink logit per head, alternating 128-token sliding-window and full layers,
YaRN RoPE, and top-k routed experts with biases and a clamped gated unit.

What transformers' ``modeling_gpt_oss`` computes, and the Megatron-Core 0.16.1 settings that compute
the same (``rltrain/megatron/model_config.py`` reads them from these facts):

- attention: ``q/k/v/o_proj`` with biases (``attention_bias``, true in every release; Megatron's
  ``add_bias_linear`` puts a bias on every linear, so a config without it is refused); the sinks
  ``self_attn.sinks`` [heads] join each softmax's denominator and add no value (``softmax_type=
  'learnable'``, the ``core_attention.softmax_offset`` parameter, split by head under TP); the
  layers ``layer_types`` marks ``sliding_attention`` see ``sliding_window`` keys (``window_size``);
- MLP: every layer routes to experts; the router (``mlp.router``, weight and bias) takes the top k
  logits and softmaxes them (Megatron's default top-k routing, ``renormalize_topk``); an expert
  computes ``(clamp(up, -c, c) + 1) · g · sigmoid(α g)``, g = ``clamp(gate, max=c)``, c =
  ``swiglu_limit`` and α = ``swiglu_alpha`` = 1.702 (Megatron's ``quick_gelu`` with
  ``glu_linear_offset=1``, ``activation_func_clamp_value=c``; another α is refused), and adds its
  output bias before its routing weight scales its output (Megatron scales the bias too);
- RoPE: YaRN with ``truncate: false`` (``rltrain/megatron/yarn.py``), rotate-half style.

The checkpoint stores each layer's experts stacked (``GroupedExperts``): ``gate_up_proj`` [experts,
hidden, 2 × ffn] with gate and up interleaved by column and the transpose of a Linear's layout,
``gate_up_proj_bias`` [experts, 2 × ffn] interleaved alike, ``down_proj`` [experts, ffn, hidden]
(transposed), ``down_proj_bias`` [experts, hidden]. The released checkpoints quantize the experts to
MXFP4 (``quantization_config.quant_method: mxfp4``: ``*_blocks`` / ``*_scales`` tensors); the bridge
reads unquantized weights only and refuses such a config in one line (dequantize with transformers
first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_bridge.dims import ModelDims
from megatron_bridge.family import ArchitectureFacts, ModelFamily, MoEFacts
from megatron_bridge.hf_config import config_value
from megatron_bridge.mappings import (
    AnyMapping,
    ColumnParallel,
    GatedMLP,
    GroupedExperts,
    Replicated,
    RowParallel,
)
from megatron_bridge.models.common import (
    TINY_SHAPE,
    H,
    L,
    attention,
    embeddings_and_head,
    sliding_window_facts,
)
from megatron_bridge.registry import register

Tensor = torch.Tensor

QUICK_GELU_ALPHA = 1.702
"""Megatron-Core's ``quick_gelu`` is ``x · sigmoid(1.702 x)``: the only ``swiglu_alpha`` it has."""


@dataclass(frozen=True)
class InterleavedGatedMLP(GatedMLP):
    """One expert's slice of ``gate_up_proj`` [hidden, 2 × ffn] (a Linear weight's transpose) or of
    ``gate_up_proj_bias`` [2 × ffn], gate and up interleaved by column (gate = ``[..., ::2]``, up =
    ``[..., 1::2]``) ↔ Megatron's ``linear_fc1`` = ``[gate; up]`` (split over TP as ``GatedMLP``)."""

    def hf_patterns(self) -> tuple[str, ...]:
        return (self.hf,)

    def hf_split_dim(self, ndim: int) -> int | None:
        """The last dim: a TP rank's ``[gate_r; up_r]`` is one contiguous block of interleaved columns."""
        return ndim - 1

    def to_megatron(self, hf: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        rows = hf[0].t() if hf[0].dim() == 2 else hf[0]  # [2 × ffn, (hidden)]
        return [torch.cat([rows[0::2], rows[1::2]], dim=0).contiguous()]

    def to_hf(self, megatron: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        gate, up = megatron[0].chunk(2, dim=0)
        rows = torch.stack([gate, up], dim=1).reshape(megatron[0].shape)  # gate 0, up 0, gate 1, ...
        return [(rows.t() if rows.dim() == 2 else rows).contiguous()]


@dataclass(frozen=True)
class TransposedRowParallel(RowParallel):
    """One expert's ``down_proj`` [ffn, hidden] (a Linear weight's transpose) ↔ Megatron's row-parallel
    ``linear_fc2`` [hidden, ffn]."""

    def hf_split_dim(self, ndim: int) -> int | None:
        return 0  # Megatron's input features (dim 1) are the HF rows

    def to_megatron(self, hf: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        return [hf[0].t().contiguous()]

    def to_hf(self, megatron: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        return [megatron[0].t().contiguous()]


def gpt_oss_attention() -> tuple[AnyMapping, ...]:
    """Norms, fused QKV with biases, output projection with its bias, and the per-head sinks."""
    return (
        *attention(bias=True),
        Replicated(L + "self_attention.linear_proj.bias", H + "self_attn.o_proj.bias"),
        ColumnParallel(L + "self_attention.core_attention.softmax_offset", H + "self_attn.sinks"),
    )


def gpt_oss_experts() -> tuple[AnyMapping, ...]:
    """The router (weight and bias) and the stacked expert tensors with their biases."""
    m = L + "mlp.experts.local_experts.*."
    e = H + "mlp.experts."
    return (
        Replicated(L + "mlp.router.weight", H + "mlp.router.weight"),
        Replicated(L + "mlp.router.bias", H + "mlp.router.bias"),
        GroupedExperts(InterleavedGatedMLP(m + "linear_fc1.weight", e + "gate_up_proj")),
        GroupedExperts(InterleavedGatedMLP(m + "linear_fc1.bias", e + "gate_up_proj_bias")),
        GroupedExperts(TransposedRowParallel(m + "linear_fc2.weight", e + "down_proj")),
        GroupedExperts(Replicated(m + "linear_fc2.bias", e + "down_proj_bias")),
    )


def even_layers(config: Any, num_layers: int) -> list[bool]:
    """GPT-OSS without ``layer_types`` (transformers' ``GptOssConfig`` fills it in so): layers 0, 2, ...
    slide, the others attend to every earlier key."""
    return [i % 2 == 0 for i in range(num_layers)]


def gpt_oss_facts(config: Any) -> ArchitectureFacts:
    """Facts of a GPT-OSS config; raises ``NotImplementedError`` naming the key Megatron cannot match."""
    get = lambda *names, default=None: config_value(config, *names, default=default)  # noqa: E731
    quantization = get("quantization_config") or {}
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise NotImplementedError(
            f"gpt_oss: quantization_config.quant_method={method!r}: the bridge reads unquantized weights "
            "only; dequantize first (transformers: from_pretrained with Mxfp4Config(dequantize=True), "
            "then save_pretrained)"
        )
    if not get("attention_bias"):
        raise NotImplementedError(
            "gpt_oss: attention_bias=false with biased experts: Megatron-Core 0.16.1's add_bias_linear "
            "puts a bias on every linear or on none"
        )
    alpha = float(get("swiglu_alpha"))
    if alpha != QUICK_GELU_ALPHA:
        raise NotImplementedError(
            f"gpt_oss: swiglu_alpha={alpha}: Megatron-Core 0.16.1's quick_gelu has alpha {QUICK_GELU_ALPHA} only"
        )
    window, layers = sliding_window_facts(config, even_layers)
    return ArchitectureFacts(
        qkv_bias=True,
        qk_norm=False,
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        moe=MoEFacts(
            num_experts=int(get("num_local_experts")),
            top_k=int(get("num_experts_per_tok")),
            ffn_hidden_size=int(get("intermediate_size")),
            renormalize_topk=True,  # softmax over the top-k logits
            aux_loss_coeff=float(get("router_aux_loss_coef")),
            biased_experts=True,
        ),
        sliding_window=window,
        sliding_layers=layers,
        linear_bias=True,
        attention_sinks=True,
        clamped_glu_limit=float(get("swiglu_limit")),
    )


HF_DEFAULTS = {
    # transformers' GptOssConfig; layer_types None: sliding on even layers, full on odd ones
    # (even_layers); rope_parameters None: YaRN, factor 32 over 4096 tokens, truncate false
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.001,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "layer_types": None,
    "rope_parameters": None,
    "rms_norm_eps": 1e-5,
}
"""What a GPT-OSS ``config.json`` that leaves out one of these keys means (``ModelFamily.hf_defaults``)."""

GPT_OSS = register(
    ModelFamily(
        name="gpt_oss",
        model_types=("gpt_oss",),
        mappings=(*embeddings_and_head(), *gpt_oss_attention(), *gpt_oss_experts()),
        facts=gpt_oss_facts,
        tiny_preset={
            **TINY_SHAPE,
            "head_dim": 32,
            "intermediate_size": 128,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "router_aux_loss_coef": 0.01,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": False,
        },
        hf_defaults=HF_DEFAULTS,
    )
)
