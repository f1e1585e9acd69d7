"""Micro-batches of a token batch in the layout Megatron's model consumes.

Contract: :class:`MicroBatching` cuts a :class:`~rltrain.algo.token_batch.TokenBatch` into
micro-batches (fixed size, or filled up to a token budget); :func:`micro_batches` turns each into a
:class:`ModelInputs`: padded rows ``[prompt (left-padded) | response (right-padded)]`` with a causal
padding mask, or (``use_remove_padding``) one packed row (THD, positions restarting per sequence,
no attention across sequences), plus the flat index of the position that predicts each response
token (the token before it) and of each row's last real token, which the heads read
(:mod:`rltrain.megatron.head_outputs`).

Context parallelism (CP > 1, packed only): each packed micro-batch pads every sequence to a
multiple of 2·CP and CP rank r keeps chunks r and 2·CP−1−r of each (Megatron's load balancing,
:func:`~rltrain.data.packing.context_parallel_index`), with the global positions and the whole
row's ``cu_seqlens`` (Megatron's THD RoPE and the attention cut their share from them). Targets
come from the unsplit batch, so a chunk boundary never loses a next token; ``held`` says which
response tokens' predictors this rank holds. A dynamic micro-batch's token budget counts the tokens
one CP rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from rltrain.algo.token_batch import TokenBatch
from rltrain.data.dynamic_batch import split_by_token_budget, split_fixed
from rltrain.data.packing import context_parallel_index, pack_sequences, padded_position_ids
from rltrain.megatron.local_spec import padded_causal_mask
from rltrain.megatron.parallel import ParallelContext


@dataclass
class MicroBatching:
    """How a batch is cut into micro-batches (verl vocabulary)."""

    micro_batch_size: int = 1
    """``ppo_micro_batch_size_per_gpu``: samples per micro-batch when not dynamic."""
    use_dynamic_bsz: bool = False
    """Fill micro-batches up to ``max_token_len`` real tokens instead of a fixed sample count."""
    max_token_len: int = 0
    """``ppo_max_token_len_per_gpu``: token budget of one micro-batch when ``use_dynamic_bsz``."""
    use_remove_padding: bool = True
    """Pack each micro-batch into one row (THD) instead of running padded rows."""

    def split(self, batch: TokenBatch, *, cp_size: int = 1) -> list[list[int]]:
        """Sample indices of each micro-batch; under CP the token budget counts one CP rank's share."""
        if self.use_dynamic_bsz:
            lengths = batch.attention_mask.sum(1).tolist()
            if cp_size > 1:
                lengths = [_cp_padded(n, cp_size) // cp_size for n in lengths]
            return split_by_token_budget(lengths, self.max_token_len)
        return split_fixed(batch.batch_size, self.micro_batch_size)


def _cp_padded(length: int, cp_size: int) -> int:
    """A sequence's length padded to a multiple of 2·CP (what the CP split cuts)."""
    return length + (-length) % (2 * cp_size)


@dataclass
class ModelInputs:
    """One micro-batch in the layout the model consumes."""

    batch: TokenBatch
    input_ids: torch.Tensor
    """[rows, tokens]: the packed row ([1, total]) or the padded rows ([batch, seq])."""
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    """[batch, 1, seq, seq] bool (True = masked) for padded rows; None when packed."""
    packed_seq_params: PackedSeqParams | None
    source_index: torch.Tensor
    """[batch, response_len] flat index into [rows × tokens] of the position predicting each response
    token (0 where the response is padding)."""
    last_index: torch.Tensor
    """[batch] flat index into [rows × tokens] of each row's last token with attention mask 1."""
    held: torch.Tensor | None = None
    """CP > 1: [batch, response_len] bool, whether this CP rank holds the position predicting each
    response token (``source_index`` is 0 where not); None without CP."""
    last_held: torch.Tensor | None = None
    """CP > 1: [batch] bool, whether this CP rank holds each row's last token; None without CP."""
    layout_index: torch.Tensor | None = None
    """[batch, seq] flat index into [rows × tokens] of each real token of ``batch`` (-1 on padding)."""
    recorded: torch.Tensor | None = None
    """Routing replay ``record``: [batch, seq, num_layers, top_k] routes this rank's routers chose."""


def _prepare(
    batch: TokenBatch,
    *,
    pack: bool,
    pad_to_multiple: int,
    min_length: int,
    device: torch.device,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> ModelInputs:
    input_ids = batch.input_ids.to(device)
    attention_mask = batch.attention_mask.to(device)
    if not pack and input_ids.size(1) % pad_to_multiple:
        # Sequence parallelism splits the sequence over TP: left-pad the prompt side (masked out).
        extra = pad_to_multiple - input_ids.size(1) % pad_to_multiple
        input_ids = torch.nn.functional.pad(input_ids, (extra, 0))
        attention_mask = torch.nn.functional.pad(attention_mask, (extra, 0))
    seq, resp = input_ids.size(1), batch.response_len
    predictor_cols = torch.arange(seq - resp - 1, seq - 1, device=device)
    valid = attention_mask[:, -resp:].bool()
    last_cols = (torch.arange(seq, device=device) * attention_mask.bool()).argmax(dim=1)
    rows = torch.arange(input_ids.size(0), device=device)
    if pack and cp_size > 1:
        return _prepare_context_parallel(
            batch,
            input_ids,
            attention_mask,
            predictor_cols=predictor_cols,
            last_cols=last_cols,
            pad_to_multiple=pad_to_multiple,
            min_length=min_length,
            cp_size=cp_size,
            cp_rank=cp_rank,
        )
    if pack:
        packed = pack_sequences(
            input_ids, attention_mask, pad_to_multiple=pad_to_multiple, min_length=min_length
        )
        cu = packed.cu_seqlens.to(device)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=packed.max_seqlen,
            max_seqlen_kv=packed.max_seqlen,
        )
        source = packed.token_index[:, predictor_cols].clamp(min=0)
        last = packed.token_index[rows, last_cols].clamp(min=0)
        return ModelInputs(
            batch,
            packed.input_ids,
            packed.position_ids,
            None,
            params,
            source * valid,
            last,
            layout_index=packed.token_index.to(device),
        )
    source = (rows.unsqueeze(1) * seq + predictor_cols.unsqueeze(0)) * valid
    extra = seq - batch.input_ids.size(1)
    cols = torch.arange(extra, seq, device=device)
    layout = rows.unsqueeze(1) * seq + cols.unsqueeze(0)
    return ModelInputs(
        batch,
        input_ids,
        padded_position_ids(attention_mask),
        padded_causal_mask(attention_mask),
        None,
        source,
        rows * seq + last_cols,
        layout_index=torch.where(attention_mask[:, extra:].bool(), layout, -1),
    )


def _prepare_context_parallel(
    batch: TokenBatch,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    predictor_cols: torch.Tensor,
    last_cols: torch.Tensor,
    pad_to_multiple: int,
    min_length: int,
    cp_size: int,
    cp_rank: int,
) -> ModelInputs:
    """The packed micro-batch cut for CP rank ``cp_rank``: its chunks of every sequence."""
    packed = pack_sequences(
        input_ids,
        attention_mask,
        pad_to_multiple=2 * cp_size * pad_to_multiple,
        min_length=min_length,
        pad_each_to_multiple=2 * cp_size,
    )
    cu = packed.cu_seqlens.to(input_ids.device)
    local = context_parallel_index(cu, cp_size=cp_size, cp_rank=cp_rank)
    local_of = torch.full((int(cu[-1]),), -1, dtype=torch.long, device=input_ids.device)
    local_of[local] = torch.arange(local.numel(), device=input_ids.device)
    valid = attention_mask[:, -batch.response_len :].bool()
    source = local_of[packed.token_index[:, predictor_cols].clamp(min=0)]
    held = (source >= 0) & valid
    rows = torch.arange(input_ids.size(0), device=input_ids.device)
    last = local_of[packed.token_index[rows, last_cols].clamp(min=0)]
    # The per-sequence padding is part of each segment (the causal mask hides it from real tokens),
    # so the padded lengths TE's CP attention asks for are the lengths themselves.
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=packed.max_seqlen,
        max_seqlen_kv=packed.max_seqlen,
    )
    return ModelInputs(
        batch,
        packed.input_ids[:, local],
        packed.position_ids[:, local],
        None,
        params,
        source.clamp(min=0) * held,
        last.clamp(min=0),
        held=held,
        last_held=last >= 0,
    )


def micro_batches(
    batch: TokenBatch, splits: list[list[int]], *, ctx: ParallelContext, batching: MicroBatching
) -> list[ModelInputs]:
    """The micro-batches of ``batch`` in the model's layout (packed rows or padded rows)."""
    pad_to = ctx.tp_size if ctx.parallel.sequence_parallel else 1
    # The interleaved (VPP) schedule cannot exchange micro-batches of different shapes between
    # stages: pad every packed row to the longest one.
    lengths = batch.attention_mask.sum(1).tolist()
    if ctx.cp_size > 1:
        lengths = [_cp_padded(n, ctx.cp_size) for n in lengths]
    min_length = max(sum(lengths[i] for i in idx) for idx in splits) if ctx.vpp_size else 0
    if ctx.vpp_size and not batching.use_remove_padding and len({len(i) for i in splits}) > 1:
        raise ValueError(
            "virtual pipeline parallelism without use_remove_padding needs equal micro-batch sizes"
        )
    return [
        _prepare(
            batch.select(idx),
            pack=batching.use_remove_padding,
            pad_to_multiple=pad_to,
            min_length=min_length,
            device=ctx.device,
            cp_size=ctx.cp_size,
            cp_rank=ctx.cp_rank,
        )
        for idx in splits
    ]
