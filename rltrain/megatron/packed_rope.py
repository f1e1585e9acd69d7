"""Rotary embedding of a packed (THD) row, with the row's cos/sin built once per forward.

Contract: ``apply_rotary_pos_emb`` takes Megatron's ``rope_utils.apply_rotary_pos_emb`` arguments and
returns exactly (bit for bit, values and gradients) what Megatron's unfused THD path returns;
``install_packed_rope()`` puts it in place of the name ``megatron.core.transformer.attention`` calls
(idempotent). Every case it does not handle itself goes to Megatron's function unchanged: no
``cu_seqlens`` (BSHD), fused RoPE (Transformer Engine), multi-latent attention, context parallelism,
or a row whose length disagrees with ``cu_seqlens``.

Why: Megatron's unfused THD path (``_apply_rotary_pos_emb_thd``), called for the query and the key
of every layer, slices the frequency table once per sequence in a Python loop, concatenates the
slices, and takes cos and sin of the result, every call. A forward of the quickstart's pack (128
sequences, 2 layers) makes 512 slices and 4 cos/sin pairs, about a tenth of a forward's time at
that model's width. Within a forward every call gets the same frequency table (Megatron caches it
per length) and the same ``cu_seqlens`` object, so the packed cos and sin are built once, with one
gather, and reused by the other calls. The arithmetic on the activations is Megatron's own
(``t·cos + rotate_half(t)·sin``, the same ops in the same order on the same tensors), hence the same
bits.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings import rope_utils

_TARGET_MODULE = "megatron.core.transformer.attention"
_TARGET_NAME = "apply_rotary_pos_emb"


@dataclass
class _PackedCosSin:
    """cos and sin of the packed row's frequencies, for one (table, ``cu_seqlens``, mscale, dtype)."""

    freqs: torch.Tensor
    cu_seqlens: torch.Tensor
    mscale: float
    dtype: torch.dtype
    cos: torch.Tensor
    sin: torch.Tensor

    def fits(self, freqs: torch.Tensor, cu_seqlens: torch.Tensor, mscale: float, dtype: torch.dtype) -> bool:
        # Identity, not equality: the entry holds both tensors, so a new tensor cannot reuse their ids.
        return (
            self.freqs is freqs
            and self.cu_seqlens is cu_seqlens
            and self.mscale == mscale
            and self.dtype == dtype
        )


_last: _PackedCosSin | None = None
"""The one entry kept: a forward's calls share it, the next micro-batch replaces it."""


def packed_positions(cu_seqlens: torch.Tensor, freqs_len: int) -> torch.Tensor:
    """[tokens] index into the frequency table for each token of the packed row, as Megatron's THD
    path picks it: the token's offset within its sequence, or, when the table has exactly as many
    rows as the packed row (Megatron's "exact mapping"), the sequence's start plus that offset."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    tokens = int(lengths.sum())
    # First packed index of each token's sequence (sequences follow one another from cu[0]).
    first = torch.repeat_interleave(cu[:-1] - cu[0], lengths)
    within = torch.arange(tokens, device=cu.device) - first
    if freqs_len == int(cu_seqlens[-1]):
        return torch.repeat_interleave(cu[:-1], lengths) + within
    return within


def _packed_cos_sin(
    freqs: torch.Tensor, cu_seqlens: torch.Tensor, mscale: float, dtype: torch.dtype
) -> _PackedCosSin:
    global _last
    if _last is None or not _last.fits(freqs, cu_seqlens, mscale, dtype):
        packed = freqs[packed_positions(cu_seqlens, freqs.size(0))]
        # Megatron's expressions, on a tensor equal to the one its loop concatenates.
        cos = (torch.cos(packed) * mscale).to(dtype)
        sin = (torch.sin(packed) * mscale).to(dtype)
        _last = _PackedCosSin(freqs, cu_seqlens, mscale, dtype, cos, sin)
    return _last


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    config: Any,
    cu_seqlens: torch.Tensor | None = None,
    mscale: float = 1.0,
    cp_group: Any = None,
) -> torch.Tensor:
    """Megatron's ``apply_rotary_pos_emb`` (same signature and result); see the module docstring."""
    if cu_seqlens is None or config.apply_rope_fusion or config.multi_latent_attention:
        return rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens, mscale, cp_group)
    group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()
    if group.size() > 1 or t.size(0) != int(cu_seqlens[-1] - cu_seqlens[0]):
        return rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens, mscale, cp_group)
    entry = _packed_cos_sin(freqs, cu_seqlens, mscale, t.dtype)
    rot_dim = freqs.shape[-1]
    x = t.unsqueeze(1)  # [tokens, 1, heads, dim], as Megatron's BSHD helper sees it
    x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    out = (x * entry.cos) + (rope_utils._rotate_half(x, config.rotary_interleaved) * entry.sin)
    if x_pass.size(-1):
        out = torch.cat((out, x_pass), dim=-1)
    return out.squeeze(1)


def install_packed_rope() -> None:
    """Make Megatron's attention apply RoPE through :func:`apply_rotary_pos_emb` (idempotent)."""
    module = importlib.import_module(_TARGET_MODULE)
    current = getattr(module, _TARGET_NAME, None)
    if current is None:
        raise RuntimeError(
            f"{_TARGET_MODULE}.{_TARGET_NAME} not found: the installed megatron-core is not the one "
            "rltrain's packed RoPE was written for"
        )
    if current is not apply_rotary_pos_emb:
        setattr(module, _TARGET_NAME, apply_rotary_pos_emb)
