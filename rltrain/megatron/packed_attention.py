"""Causal attention over a packed (THD) row, each sequence attending only within itself.

Contract: ``packed_causal_attention(query, key, value, cu_seqlens, scale=..., dropout_p=...)`` takes
query [tokens, heads, dim] and key/value [tokens, groups, dim] (grouped-query attention: query head
h reads key/value group ``h // (heads // groups)``, as Megatron's ``repeat_interleave``), and the
cumulative sequence lengths [num_segments + 1] of the row; it returns [tokens, heads, dim], equal
(to rounding) to softmax(scale · q kᵀ) v under a block-diagonal causal mask, without ever building
that [tokens, tokens] mask or score matrix.

How: the segments are grouped by length class (lengths in (2^(k-1), 2^k] share a group), each
group is gathered into [segments, heads, longest, dim] with the shorter segments padded at the end,
and one ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)`` runs per group.
End padding is harmless under a causal mask: a real query never sees a later (padded) key, and the
padded queries' outputs are dropped, so their gradients are exactly zero. Padding at most doubles a
group, so memory stays linear in the pack (plus what SDPA needs per segment), and the number of
attention calls is at most log2(longest segment) + 1 per layer, not one per sequence.
Context parallelism: ``context_parallel_causal_attention`` is the same computation for the queries
one CP rank holds (chunks r and 2·CP−1−r of every segment, see
:func:`rltrain.data.packing.context_parallel_index`) against the whole row's keys/values (gathered
from every CP rank). Each query attends to the keys of its segment whose global position is not
after its own. Each of the rank's two chunks runs on its own against only the keys up to its end
(chunk r reads (r+1)/(2·CP) of the segment, chunk 2·CP−1−r reads (2·CP−r)/(2·CP)). Segments with
chunks of at least ``MERGED_MIN_CHUNK`` tokens are grouped by exact length and run mask-free: the
keys before the chunk (all visible) and the chunk's own keys (a causal square) in two flash calls
merged by their log-sum-exp, with the matching backward (``_PrefixCausalAttention``; no dropout).
Shorter segments (and any segment under attention dropout) share one masked call per length class
and chunk ([segments, chunk, keys] bools), never a mask over the whole pack.
Pure torch (no Megatron or distributed import), so that it can be tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rltrain.data.packing import context_parallel_index


@dataclass
class SegmentGroup:
    """Segments of similar length, gathered together into one padded batch."""

    gather_index: torch.Tensor
    """[segments, longest] long: packed position of each (segment, offset); offsets past a segment's
    end repeat its last token (never seen by a real query under the causal mask)."""
    valid: torch.Tensor
    """[segments, longest] bool: offset < segment length."""


def segment_groups(cu_seqlens: torch.Tensor) -> list[SegmentGroup]:
    """cu_seqlens: [num_segments + 1] → the groups of non-empty segments, one per length class."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = cu_seqlens[:-1].long()
    by_class: dict[int, list[int]] = {}
    for segment, length in enumerate(lengths.tolist()):
        if length > 0:
            by_class.setdefault((length - 1).bit_length(), []).append(segment)
    groups = []
    for members in by_class.values():
        index = torch.tensor(members, device=cu_seqlens.device)
        group_lengths, group_starts = lengths[index], starts[index]
        offsets = torch.arange(int(group_lengths.max()), device=cu_seqlens.device)
        last = (group_lengths - 1).unsqueeze(1)
        gather_index = group_starts.unsqueeze(1) + torch.minimum(offsets.unsqueeze(0), last)
        groups.append(SegmentGroup(gather_index=gather_index, valid=offsets.unsqueeze(0) <= last))
    return groups


def window_keys(length: int, left: int, *, device: torch.device | None = None) -> torch.Tensor:
    """[length, length] bool: True where query i may see key j under a causal sliding window of
    ``left`` keys behind it (Megatron's ``window_size=(left, 0)``): i - left <= j <= i."""
    position = torch.arange(length, device=device)
    behind = position.unsqueeze(1) - position.unsqueeze(0)  # query position - key position
    return (behind >= 0) & (behind <= left)


def packed_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    dropout_p: float = 0.0,
    window_left: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query/key [tokens, heads|groups, dim], value [tokens, groups, v_dim] → [tokens, heads, v_dim]
    (``v_dim`` differs from ``dim`` under multi-latent attention).

    ``dropout_p`` drops attention probabilities (scaled by 1/(1-p)) as Megatron's attention dropout
    does, drawing from torch's default generator of the device. ``window_left``: sliding-window
    attention, each query at offset i sees only the keys at i - window_left .. i of its sequence
    (Megatron's ``window_size[0]``); one [longest, longest] mask per length class. ``sinks`` [heads]:
    attention sinks (``sink_attention``).
    """
    tokens, heads, _ = query.shape
    if int(cu_seqlens[-1]) != tokens:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but the packed row has {tokens} tokens")
    if (
        key.shape[:2] != value.shape[:2]
        or key.size(-1) != query.size(-1)
        or key.size(0) != tokens
        or heads % key.size(1)
    ):
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit query {tuple(query.shape)}"
        )
    repeats = heads // key.size(1)
    plan = _row_plan(cu_seqlens)
    outputs = []
    for group, (rows, offsets) in zip(plan.groups, plan.valid):
        # [segments, longest, heads, dim] → [segments, heads, longest, dim]
        q, k, v = (t[group.gather_index].transpose(1, 2) for t in (query, key, value))
        if repeats > 1:
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        if sinks is not None:
            allowed = window_keys(
                q.size(2), q.size(2) if window_left is None else window_left, device=q.device
            )
            out = sink_attention(q, k, v, allowed, sinks, scale=scale, dropout_p=dropout_p)
        elif window_left is None:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
        else:
            allowed = window_keys(q.size(2), window_left, device=q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=scale)
        outputs.append(out.transpose(1, 2)[rows, offsets])
    if plan.order is None:  # one group whose valid rows are already the packed order
        return outputs[0]
    return torch.cat(outputs).index_select(0, plan.order)


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    sinks: torch.Tensor,
    *,
    scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention with a sink logit per head: q/k/v [batch, heads, seq, dim], ``allowed`` [seq, seq]
    (True: query may see key), ``sinks`` [heads]. Each head's softmax runs over its allowed scores and
    its sink; the sink's probability is dropped (it carries no value), so the rows sum to less than
    one (transformers' GPT-OSS ``eager_attention_forward``, Megatron's ``SoftmaxOne``). Scores and
    softmax in fp32 at least (SDPA has no sinks: the [seq, seq] scores are materialized per batch)."""
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(wide), k.to(wide).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(wide).view(1, -1, 1, 1).expand(scores.size(0), -1, scores.size(2), 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs.to(v.dtype), v)


@dataclass
class _RowPlan:
    """What ``packed_causal_attention`` derives from ``cu_seqlens`` alone, kept for the row's other
    layers: the groups, each group's valid (segment, offset) pairs (``valid.nonzero()`` as index
    tensors), and the packed order of the concatenated groups' outputs (None when there is one group
    and its valid pairs, row by row, are the packed positions in order: its output is then the
    result as it stands, without two copies of it)."""

    cu_seqlens: torch.Tensor
    groups: list[SegmentGroup]
    valid: list[tuple[torch.Tensor, torch.Tensor]]
    order: torch.Tensor | None


_last_plan: _RowPlan | None = None
"""One entry: every layer of a forward gets the same ``cu_seqlens`` object (identity is checked, and
the entry holds the tensor, so a new one cannot reuse its id); the next micro-batch replaces it."""


def _row_plan(cu_seqlens: torch.Tensor) -> _RowPlan:
    global _last_plan
    if _last_plan is None or _last_plan.cu_seqlens is not cu_seqlens:
        groups = segment_groups(cu_seqlens)
        valid = [tuple(group.valid.nonzero().unbind(1)) for group in groups]
        positions = torch.cat(
            [group.gather_index[rows, offsets] for group, (rows, offsets) in zip(groups, valid)]
        )
        tokens = int(cu_seqlens[-1])
        identity = torch.arange(tokens, device=cu_seqlens.device)
        if len(groups) == 1 and torch.equal(positions, identity):
            order = None
        else:
            order = torch.empty(tokens, dtype=torch.long, device=cu_seqlens.device)
            order[positions] = identity
        _last_plan = _RowPlan(cu_seqlens, groups, valid, order)
    return _last_plan


def context_parallel_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    cp_size: int,
    cp_rank: int,
    scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """query [tokens / cp_size, heads, dim] (this CP rank's share, in ``context_parallel_index``
    order), key/value [tokens, groups, dim] (the whole row, packed order), cu_seqlens of the whole
    row (every segment a multiple of 2·cp_size) → [tokens / cp_size, heads, dim]."""
    tokens = int(cu_seqlens[-1])
    if (
        key.shape[:2] != value.shape[:2]
        or key.size(-1) != query.size(-1)
        or key.size(0) != tokens
        or query.size(1) % key.size(1)
    ):
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit cu_seqlens (ends at {tokens})"
            f" and query {tuple(query.shape)}"
        )
    if query.size(0) * cp_size != tokens:
        raise ValueError(
            f"query has {query.size(0)} tokens; CP rank share of {tokens} is {tokens // cp_size}"
        )
    device = query.device
    # Global position (within its segment) of each local query.
    local_index = context_parallel_index(cu_seqlens, cp_size=cp_size, cp_rank=cp_rank)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = cu_seqlens[:-1].long()
    segment_of = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    query_pos = local_index - starts[segment_of[local_index]]
    repeats = query.size(1) // key.size(1)
    outputs, positions = [], []
    for members, merged in _cp_segment_groups(lengths, cp_size=cp_size, merged=dropout_p == 0.0):
        seg_lengths, seg_starts = lengths[members], starts[members]
        chunk, q_starts = seg_lengths // (2 * cp_size), seg_starts // cp_size
        longest = int(chunk.max())
        offsets = torch.arange(longest, device=device)
        q_last = (chunk - 1).unsqueeze(1)
        valid = offsets.unsqueeze(0) <= q_last
        # Each of the rank's two chunks (index cp_rank, then 2·CP−1−cp_rank) reads keys only up to
        # its own end: the mirrored chunk sees most of the segment, the early one little of it.
        for half, chunk_id in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
            q_index = (q_starts + half * chunk).unsqueeze(1) + torch.minimum(offsets.unsqueeze(0), q_last)
            k_offsets = torch.arange(longest * (chunk_id + 1), device=device)
            # Keys past a segment's end repeat its last token at offsets after all its queries.
            k_index = seg_starts.unsqueeze(1) + torch.minimum(
                k_offsets.unsqueeze(0), (seg_lengths - 1).unsqueeze(1)
            )
            q = query[q_index].transpose(1, 2)
            if merged:  # one chunk length: keys before the chunk all visible, then a causal square
                split = longest * chunk_id
                parts = [
                    _gather_heads(t, k_index[:, a:b], repeats)
                    for a, b in ((0, split), (split, None))
                    for t in (key, value)
                ]
                out = _PrefixCausalAttention.apply(q, *parts, scale)
            else:
                allowed = k_offsets.view(1, 1, -1) <= query_pos[q_index].unsqueeze(-1)
                k, v = (_gather_heads(t, k_index, repeats) for t in (key, value))
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=allowed.unsqueeze(1), dropout_p=dropout_p, scale=scale
                )
            outputs.append(out.transpose(1, 2)[valid])
            positions.append(q_index[valid])
    local_tokens = query.size(0)
    order = torch.empty(local_tokens, dtype=torch.long, device=device)
    order[torch.cat(positions)] = torch.arange(local_tokens, device=device)
    return torch.cat(outputs).index_select(0, order)


MERGED_MIN_CHUNK = 128
"""Under CP, segments whose chunks are at least this long run mask-free (``_PrefixCausalAttention``,
grouped by exact length); shorter ones share a masked call per length class."""


def _cp_segment_groups(
    lengths: torch.Tensor, *, cp_size: int, merged: bool
) -> list[tuple[torch.Tensor, bool]]:
    """(segment indices, mask-free?) groups of the non-empty segments: long segments (``merged``
    allowed) by exact length, the others by length class as ``segment_groups``."""
    groups: dict[tuple[bool, int], list[int]] = {}
    for segment, length in enumerate(lengths.tolist()):
        if length == 0:
            continue
        exact = merged and length // (2 * cp_size) >= MERGED_MIN_CHUNK
        groups.setdefault((exact, length if exact else (length - 1).bit_length()), []).append(segment)
    return [(torch.tensor(m, device=lengths.device), exact) for (exact, _), m in groups.items()]


def _gather_heads(t: torch.Tensor, index: torch.Tensor, repeats: int) -> torch.Tensor:
    """t [tokens, groups, dim], index [segments, n] → [segments, groups × repeats, n, dim]."""
    out = t[index].transpose(1, 2)
    return out.repeat_interleave(repeats, dim=1) if repeats > 1 else out


class _PrefixCausalAttention(torch.autograd.Function):
    """Attention of a chunk's queries to [keys before the chunk (all visible) | the chunk's own keys
    (causal)] without a mask: two flash calls merged by their log-sum-exp. The backward runs the
    flash backward of each part with the merged output and log-sum-exp, which gives each part's
    share of the gradient exactly (the softmax probabilities and the row term they use are the
    merged ones). q [segments, heads, c, dim], prefix [segments, heads, j·c, dim] (j·c may be 0),
    own [segments, heads, c, dim]."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k_prefix: torch.Tensor,
        v_prefix: torch.Tensor,
        k_own: torch.Tensor,
        v_own: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = flash(q, k_own, v_own, 0.0, True, scale=scale)
        if k_prefix.size(2):
            out_prefix, lse_prefix = flash(q, k_prefix, v_prefix, 0.0, False, scale=scale)
            merged = torch.logaddexp(lse_prefix, lse)
            wide = torch.promote_types(q.dtype, torch.float32)  # merge bf16 halves in fp32
            out = (
                out_prefix.to(wide) * (lse_prefix - merged).exp().unsqueeze(-1)
                + out.to(wide) * (lse - merged).exp().unsqueeze(-1)
            ).to(q.dtype)
            lse = merged
        ctx.save_for_backward(q, k_prefix, v_prefix, k_own, v_own, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        q, k_prefix, v_prefix, k_own, v_own, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk_own, dv_own = backward(grad, q, k_own, v_own, out, lse, 0.0, True, scale=ctx.scale)
        dk_prefix, dv_prefix = torch.zeros_like(k_prefix), torch.zeros_like(v_prefix)
        if k_prefix.size(2):
            dq_prefix, dk_prefix, dv_prefix = backward(
                grad, q, k_prefix, v_prefix, out, lse, 0.0, False, scale=ctx.scale
            )
            dq = dq + dq_prefix
        return dq, dk_prefix, dv_prefix, dk_own, dv_own, None
