"""The layer spec used without CUDA: Megatron's local spec with two modules swapped in.

* ``PackedDotProductAttention``: Megatron's local ``DotProductAttention`` refuses ``packed_seq_params``
  (only TE's attention takes the THD format). This one accepts it and attends within each sequence of
  the packed row (``cu_seqlens``) through ``packed_attention.packed_causal_attention``: per-segment
  causal attention, never a [tokens, tokens] mask, with Megatron's softmax scale (including
  ``apply_query_key_layer_scaling``), grouped-query heads and attention dropout. It equals Megatron's
  masked path with a block-diagonal causal mask to rounding (tested). RoPE positions restart per
  sequence through Megatron's own THD rotary path. Sliding windows and softmax offsets are refused.
* ``RMSNorm``: Megatron's ``WrappedTorchNorm`` asserts "sequence parallel not supported by torch
  LayerNorm"; this torch RMSNorm marks its weight ``sequence_parallel`` so that Megatron all-reduces
  its gradient over TP, which is all sequence parallelism needs from a norm.

Also the attention masks for padded (not packed) batches.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from rltrain.megatron.packed_attention import packed_causal_attention


def padded_causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """attention_mask: [batch, seq] (1 = token) → [batch, 1, seq, seq], True where forbidden.

    Keys that are padding are masked; fully masked (padding) query rows are harmless: their outputs
    are never read.
    """
    seq = attention_mask.size(1)
    future = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).triu(1)
    pad_key = ~attention_mask.bool()[:, None, None, :]
    return future[None, None] | pad_key


class PackedDotProductAttention(DotProductAttention):
    """``DotProductAttention`` that also takes THD-packed rows (``packed_seq_params.qkv_format='thd'``)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Packed: query/key/value [tokens, heads, dim] → [tokens, 1, heads × dim]."""
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}; expected 'thd'")
        if attention_bias is not None:
            raise NotImplementedError(
                "attention_bias with packed sequences: not supported by the CPU attention"
            )
        if self.scale_mask_softmax.window_size is not None or self.softmax_offset is not None:
            raise NotImplementedError(
                "sliding-window attention or softmax_type != 'vanilla' with packed sequences: "
                "not supported by the CPU attention"
            )
        cu_seqlens = packed_seq_params.cu_seqlens_q
        if packed_seq_params.cu_seqlens_kv is not None and not torch.equal(
            packed_seq_params.cu_seqlens_kv, cu_seqlens
        ):
            raise ValueError(
                "packed_seq_params: cu_seqlens_kv differs from cu_seqlens_q (self-attention only)"
            )
        # Megatron divides the scale by the layer number under apply_query_key_layer_scaling and
        # multiplies it back in the softmax: the product is the scale the scores get.
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        dropout_p = self.attention_dropout.p if self.training else 0.0
        # Dropout draws from the model-parallel RNG stream unless sequence parallel, as Megatron's.
        forked = dropout_p > 0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if forked else nullcontext():
            context = packed_causal_attention(query, key, value, cu_seqlens, scale=scale, dropout_p=dropout_p)
        return context.reshape(context.size(0), 1, self.hidden_size_per_partition)


class RMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm with Megatron's norm constructor; its weight joins the sequence-parallel grad all-reduce."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def local_block_spec(config: TransformerConfig, *, vp_stage: int | None) -> TransformerBlockSubmodules:
    """The decoder-block spec of this pipeline stage (or virtual stage) for a CPU run."""
    layer = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm, normalization="RMSNorm"
    )
    layer.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    layer.submodules.input_layernorm = RMSNorm
    layer.submodules.pre_mlp_layernorm = RMSNorm
    if config.qk_layernorm:
        layer.submodules.self_attention.submodules.q_layernorm = RMSNorm
        layer.submodules.self_attention.submodules.k_layernorm = RMSNorm
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=RMSNorm)
