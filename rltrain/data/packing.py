"""Sequence packing (verl's ``use_remove_padding``): padded rows → one row of real tokens.

Contract: ``pack_sequences(input_ids, attention_mask)`` keeps the tokens where ``attention_mask`` is 1,
row by row, in one packed row with cumulative sequence lengths (``cu_seqlens``) and position ids that
restart at 0 for every sequence. ``token_index`` maps each padded position to its packed position
(-1 for padding), so outputs computed on the packed row can be read back in the padded layout.
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
    input_ids: torch.Tensor, attention_mask: torch.Tensor, *, pad_to_multiple: int = 1, min_length: int = 0
) -> PackedRow:
    """input_ids, attention_mask: [batch, seq] → a ``PackedRow`` of the real tokens, padded to at
    least ``min_length`` tokens and to a multiple of ``pad_to_multiple``."""
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    num_real = int(lengths.sum())
    target = max(num_real, min_length)
    pad = target - num_real + (-target) % pad_to_multiple
    if pad:
        lengths = torch.cat([lengths, lengths.new_tensor([pad])])
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=input_ids.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    position_ids = torch.arange(num_real + pad, device=input_ids.device) - starts
    packed = torch.cat([input_ids[mask], input_ids.new_zeros(pad)])
    token_index = torch.where(mask, mask.flatten().long().cumsum(0).view_as(mask) - 1, -1)
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
