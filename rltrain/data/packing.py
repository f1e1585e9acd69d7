"""Sequence packing (verl's ``use_remove_padding``): padded rows → one row of real tokens.

Contract: ``pack_sequences(input_ids, attention_mask)`` keeps the tokens where ``attention_mask`` is 1,
row by row, in one packed row with cumulative sequence lengths (``cu_seqlens``) and position ids that
restart at 0 for every sequence. ``token_index`` maps each padded position to its packed position
(-1 for padding), so outputs computed on the packed row can be read back in the padded layout.

Context parallelism (CP): ``pack_sequences(..., pad_each_to_multiple=2·CP)`` pads every sequence at
its end to a multiple of 2·CP (positions continue through the padding, so a causal mask hides it
from the real tokens), and ``context_parallel_index(cu_seqlens, cp_size=..., cp_rank=...)`` gives the
packed positions CP rank r holds: each segment is cut into 2·CP equal chunks and rank r takes chunks
r and 2·CP−1−r (Megatron's load balancing for causal attention, the order its THD RoPE expects).
Pure torch; no model or distributed imports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedRow:
    """Several sequences concatenated into one row."""

    input_ids: torch.Tensor
    """[1, total_tokens] real tokens of every sequence, then ``pad_tokens`` zeros."""
    position_ids: torch.Tensor
    """[1, total_tokens] 0..len-1 within each sequence (and within the padding segment)."""
    cu_seqlens: torch.Tensor
    """[num_segments + 1] int32 cumulative lengths; a trailing padding segment is its own segment."""
    max_seqlen: int
    """Longest segment."""
    token_index: torch.Tensor
    """[batch, seq] long: packed position of each padded position, -1 where ``attention_mask`` is 0."""
    pad_tokens: int
    """Tokens appended to reach ``min_length`` and a multiple of ``pad_to_multiple``."""


def pack_sequences(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    pad_to_multiple: int = 1,
    min_length: int = 0,
    pad_each_to_multiple: int = 1,
) -> PackedRow:
    """input_ids, attention_mask: [batch, seq] → a ``PackedRow`` of the real tokens, padded to at
    least ``min_length`` tokens and to a multiple of ``pad_to_multiple``.

    ``pad_each_to_multiple`` > 1 also pads each sequence at its end (zeros, inside its own segment)
    to a multiple of it; the trailing padding segment then only fills up to ``pad_to_multiple``,
    which must be a multiple of ``pad_each_to_multiple`` so that it splits the same way."""
    if pad_to_multiple % pad_each_to_multiple:
        raise ValueError(
            f"pad_to_multiple={pad_to_multiple} is not a multiple of pad_each_to_multiple={pad_each_to_multiple}"
        )
    mask = attention_mask.bool()
    real_lengths = mask.sum(dim=1)
    lengths = real_lengths + (-real_lengths) % pad_each_to_multiple
    num_kept = int(lengths.sum())
    target = max(num_kept, min_length)
    pad = target - num_kept + (-target) % pad_to_multiple
    if pad:
        lengths = torch.cat([lengths, lengths.new_tensor([pad])])
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=input_ids.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    position_ids = torch.arange(num_kept + pad, device=input_ids.device) - starts
    if pad_each_to_multiple == 1:
        packed = torch.cat([input_ids[mask], input_ids.new_zeros(pad)])
        token_index = torch.where(mask, mask.flatten().long().cumsum(0).view_as(mask) - 1, -1)
    else:
        # Rank of each real token within its row, plus where its (padded) sequence starts.
        row_start = cu_seqlens[: mask.size(0)].long().unsqueeze(1)
        token_index = torch.where(mask, row_start + mask.long().cumsum(1) - 1, -1)
        packed = input_ids.new_zeros(num_kept + pad)
        packed[token_index[mask]] = input_ids[mask]
    return PackedRow(
        input_ids=packed.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=int(lengths.max()) if lengths.numel() else 0,
        token_index=token_index,
        pad_tokens=pad,
    )


def padded_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """[batch, seq] positions counting real tokens only (0 at each row's first token, 0 on left pads)."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def context_parallel_index(cu_seqlens: torch.Tensor, *, cp_size: int, cp_rank: int) -> torch.Tensor:
    """cu_seqlens: [num_segments + 1], every segment a multiple of 2·``cp_size`` long → [tokens / cp_size]
    long: the packed positions CP rank ``cp_rank`` holds, segment by segment, chunk ``cp_rank`` then
    chunk 2·cp_size−1−cp_rank of each (chunk = segment length / (2·cp_size))."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    if bool((lengths % (2 * cp_size)).any()):
        raise ValueError(f"segment lengths {lengths.tolist()} are not all multiples of 2·CP = {2 * cp_size}")
    chunk = lengths // (2 * cp_size)
    starts = cu_seqlens[:-1].long()
    first = starts + cp_rank * chunk
    second = starts + (2 * cp_size - 1 - cp_rank) * chunk
    # Per segment: [first, first + chunk) then [second, second + chunk).
    chunk_starts = torch.stack([first, second], dim=1).flatten()
    chunk_lengths = chunk.repeat_interleave(2)
    within = torch.arange(int(chunk_lengths.sum()), device=cu_seqlens.device) - torch.repeat_interleave(
        chunk_lengths.cumsum(0) - chunk_lengths, chunk_lengths
    )
    return torch.repeat_interleave(chunk_starts, chunk_lengths) + within
