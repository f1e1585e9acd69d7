"""The layer spec used without CUDA: Megatron's local spec with three modules swapped in.

* ``PackedDotProductAttention``: Megatron's local ``DotProductAttention`` refuses ``packed_seq_params``
  (only TE's attention takes the THD format). This one accepts it and attends within each sequence of
  the packed row (``cu_seqlens``) through ``packed_attention.packed_causal_attention``: per-segment
  causal attention, never a [tokens, tokens] mask, with Megatron's softmax scale (including
  ``apply_query_key_layer_scaling``), grouped-query heads and attention dropout. It equals Megatron's
  masked path with a block-diagonal causal mask to rounding (tested). RoPE positions restart per
  sequence as in Megatron's own THD rotary path (``packed_rope``: the same bits, with the row's
  cos/sin built once a forward instead of per sequence, query and layer). Sliding windows
  (``window_size``, a left window) are applied here on both the packed and the padded path
  (Megatron's own softmax would drop the padding mask in favour of the window's). Attention sinks
  (``softmax_type='learnable'``, GPT-OSS) join each head's softmax on the packed path
  (``packed_attention.sink_attention``) and, on the padded path, through Megatron's own ``SoftmaxOne``;
  with context parallelism they are refused.
  Under context parallelism (Megatron's ``DotProductAttention`` refuses CP > 1; only TE's attention
  has it) each CP rank holds chunks r and 2·CP−1−r of every sequence (``micro_batches._prepare``): the
  keys/values are all-gathered over the CP group (the backward sums their gradients over the group
  and keeps each rank's own share), put back in packed order, and the local queries attend to them
  causally by global position (``packed_attention.context_parallel_causal_attention``).
* ``ExpertRowParallelLinear``: a routed expert's output projection whose biased output Megatron
  adds to in place (a copy, so that training works; GPT-OSS).
* ``RMSNorm``: Megatron's ``WrappedTorchNorm`` asserts "sequence parallel not supported by torch
  LayerNorm"; this torch RMSNorm marks its weight ``sequence_parallel`` so that Megatron all-reduces
  its gradient over TP, which is all sequence parallelism needs from a norm.

Also the attention masks for padded (not packed) batches.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from rltrain.data.packing import context_parallel_index
from rltrain.megatron.packed_attention import (
    context_parallel_causal_attention,
    packed_causal_attention,
    window_keys,
)
from rltrain.megatron.packed_rope import install_packed_rope


def padded_causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """attention_mask: [batch, seq] (1 = token) → [batch, 1, seq, seq], True where forbidden.

    Keys that are padding are masked; fully masked (padding) query rows are harmless: their outputs
    are never read.
    """
    seq = attention_mask.size(1)
    future = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).triu(1)
    pad_key = ~attention_mask.bool()[:, None, None, :]
    return future[None, None] | pad_key


class _GatherOverContextParallel(torch.autograd.Function):
    """[local, ...] on each CP rank → [cp × local, ...] (rank order); backward: sum the gradient over
    the group and return this rank's slice (a reduce-scatter written as all-reduce: gloo has none)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(ctx.size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size)[ctx.rank], None


def gather_sequence_over_cp(
    local: torch.Tensor, cu_seqlens: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """This CP rank's tokens [tokens / cp, ...] → the whole packed row [tokens, ...] in packed order."""
    size = dist.get_world_size(group)
    gathered = _GatherOverContextParallel.apply(local, group)
    held = torch.cat([context_parallel_index(cu_seqlens, cp_size=size, cp_rank=r) for r in range(size)])
    order = torch.empty_like(held)
    order[held] = torch.arange(held.numel(), device=held.device)
    return gathered.index_select(0, order)


class PackedDotProductAttention(DotProductAttention):
    """``DotProductAttention`` that also takes THD-packed rows (``packed_seq_params.qkv_format='thd'``),
    with or without context parallelism."""

    def __init__(
        self,
        config: TransformerConfig,
        *args: Any,
        k_channels: int | None = None,
        v_channels: int | None = None,
        **kwargs: Any,
    ) -> None:
        # The parent refuses CP > 1 (it has no CP attention); this class brings its own.
        single = copy.copy(config)
        single.context_parallel_size = 1
        # MLA passes its query/key and value head sizes, which the parent does not take:
        #   TypeError: DotProductAttention.__init__() got an unexpected keyword argument 'k_channels'
        # It also passes softmax_scale (from the q/k head size); the output has v_channels per head.
        super().__init__(single, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels
        self.config = config
        # Megatron's softmax replaces the given mask by the window mask (padding would be lost):
        # this class applies the window itself, on top of the causal or padding mask.
        self.window_size = self.scale_mask_softmax.window_size
        self.scale_mask_softmax.window_size = None
        if self.window_size is not None and self.window_size[1] != 0:
            raise NotImplementedError(
                f"window_size={tuple(self.window_size)}: the CPU attention has causal left windows only"
            )
        self.cp_group = getattr(self.pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
        if isinstance(self.softmax_offset, torch.nn.Parameter):
            # the learnable sinks: one per local head, split over TP by head (Megatron leaves the
            # parameter unmarked, so the gradient norm would count it as replicated over TP)
            tensor_parallel.set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)

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
        cp_size = self.config.context_parallel_size
        if packed_seq_params is None:
            if cp_size > 1:
                raise NotImplementedError(
                    "context_parallel_size > 1 needs packed sequences (use_remove_padding=true) on the CPU path"
                )
            if self.window_size is not None:  # True = forbidden, as Megatron's masks
                outside = ~window_keys(query.size(0), self.window_size[0], device=query.device)[None, None]
                attention_mask = outside if attention_mask is None else attention_mask | outside
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}; expected 'thd'")
        if attention_bias is not None:
            raise NotImplementedError(
                "attention_bias with packed sequences: not supported by the CPU attention"
            )
        if self.softmax_offset is not None and cp_size > 1:
            raise NotImplementedError(
                f"softmax_type={self.config.softmax_type!r} (attention sinks) with context_parallel_size="
                f"{cp_size}: the CPU attention has sinks without context parallelism only"
            )
        if self.window_size is not None and cp_size > 1:
            raise NotImplementedError(
                f"window_size={tuple(self.window_size)} with context_parallel_size={cp_size}: "
                "the CPU attention has sliding windows without context parallelism only"
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
            if cp_size > 1:
                key, value = (gather_sequence_over_cp(t, cu_seqlens, self.cp_group) for t in (key, value))
                context = context_parallel_causal_attention(
                    query,
                    key,
                    value,
                    cu_seqlens,
                    cp_size=cp_size,
                    cp_rank=dist.get_rank(self.cp_group),
                    scale=scale,
                    dropout_p=dropout_p,
                )
            else:
                context = packed_causal_attention(
                    query,
                    key,
                    value,
                    cu_seqlens,
                    scale=scale,
                    dropout_p=dropout_p,
                    window_left=None if self.window_size is None else self.window_size[0],
                    sinks=self.softmax_offset,
                )
        return context.reshape(context.size(0), 1, self.hidden_size_per_partition)


class ExpertRowParallelLinear(tensor_parallel.RowParallelLinear):
    """A routed expert's ``linear_fc2``: with a bias (GPT-OSS), its output is a copy. Megatron-Core
    0.16.1's expert MLP adds the routing-weighted bias in place to what this layer returns
    (``MLP.forward``: ``output += output_bias * per_token_scale``), which is the TP all-reduce's
    input returned as-is, and autograd refuses that in training: "Output 0 of
    _ReduceFromModelParallelRegion is a view and is being modified inplace". Unbiased: unchanged."""

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        output, bias = super().forward(input_, *args, **kwargs)
        return (output if bias is None else output.clone()), bias


class RMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm with Megatron's norm constructor; its weight joins the sequence-parallel grad all-reduce."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def _local_layer_spec(config: TransformerConfig, *, num_experts: int | None) -> Any:
    mla = bool(getattr(config, "multi_latent_attention", False))
    layer = get_gpt_layer_local_spec(
        num_experts=num_experts,
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=mla,
        normalization="RMSNorm",
    )
    attention = layer.submodules.self_attention.submodules
    attention.core_attention = PackedDotProductAttention
    if num_experts:
        layer.submodules.mlp.submodules.experts.submodules.linear_fc2 = ExpertRowParallelLinear
    layer.submodules.input_layernorm = RMSNorm
    layer.submodules.pre_mlp_layernorm = RMSNorm
    if config.qk_layernorm:
        attention.q_layernorm = RMSNorm
        if mla:
            attention.kv_layernorm = RMSNorm
        else:
            attention.k_layernorm = RMSNorm
    return layer


def local_block_spec(config: TransformerConfig, *, vp_stage: int | None) -> TransformerBlockSubmodules:
    """The decoder-block spec of this pipeline stage (or virtual stage) for a CPU run; with a
    per-layer ``moe_layer_freq`` list, layers marked 0 get a dense MLP. Megatron's attention then
    applies RoPE to packed rows through ``packed_rope`` (the same bits, cos/sin built once a forward)."""
    install_packed_rope()
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    pattern = config.moe_layer_freq
    if config.num_moe_experts and isinstance(pattern, list):
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        specs = {
            kind: _local_layer_spec(config, num_experts=config.num_moe_experts if kind else None)
            for kind in set(pattern)
        }
        layers = [specs[pattern[offset + i]] for i in range(num_layers)]
    else:
        layers = [_local_layer_spec(config, num_experts=config.num_moe_experts)] * num_layers
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=RMSNorm)


def local_mtp_block_spec(
    config: TransformerConfig, block: TransformerBlockSubmodules, *, vp_stage: int | None
) -> Any:
    """The multi-token-prediction block of this stage for a CPU run (None where it has none):
    Megatron's own, built from the stage's last decoder layer spec, with this module's RMSNorm
    for ``enorm``, ``hnorm`` and ``final_layernorm``."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend

    class _Norms(LocalSpecProvider):
        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
            return RMSNorm

    return get_gpt_mtp_block_spec_for_backend(config, block, _Norms(), vp_stage=vp_stage)
