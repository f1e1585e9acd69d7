"""The layer spec used without CUDA: Megatron's local spec with two modules swapped in.

* ``PackedDotProductAttention``: Megatron's local ``DotProductAttention`` refuses ``packed_seq_params``
  (only TE's attention takes the THD format). This one accepts it by turning the cumulative sequence
  lengths into a block-diagonal causal mask over the packed row, so packed sequences never attend to
  each other. RoPE positions restart per sequence through Megatron's own THD rotary path
  (``cu_seqlens``). The mask is [tokens, tokens] per packed row: fine for CPU-sized runs.
* ``RMSNorm``: Megatron's ``WrappedTorchNorm`` asserts "sequence parallel not supported by torch
  LayerNorm"; this torch RMSNorm marks its weight ``sequence_parallel`` so that Megatron all-reduces
  its gradient over TP, which is all sequence parallelism needs from a norm.

Also the attention masks for padded (not packed) batches.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build


def packed_causal_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """cu_seqlens: [num_seqs + 1] → mask [1, 1, tokens, tokens], True where attention is forbidden."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    total = seq_id.numel()
    future = torch.ones(total, total, dtype=torch.bool, device=cu_seqlens.device).triu(1)
    return ((seq_id[:, None] != seq_id[None, :]) | future)[None, None]


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
        mask = packed_causal_mask(packed_seq_params.cu_seqlens_q)
        return super().forward(
            query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask, attn_mask_type, attention_bias
        )


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
