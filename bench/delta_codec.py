"""Lossless sparse-delta encodings of a bf16 weight update, for ``bench/sparse_delta.py``.

Contract: every function works on one flat tensor's bf16 bit patterns (``torch.int16``, the bytes a
bf16 engine holds; ``bf16_bits`` makes them). ``encode_*(prev, new)`` returns a ``Delta`` that
``decode(prev, delta)`` turns back into ``new`` bit for bit; ``Delta.num_bytes`` is what a transport
would send for it. Three encodings:

- ``positions``: the changed elements' flat indices as int32 (4 bytes each) and their new bit
  patterns (2 bytes each): ``6 k`` bytes for ``k`` changed elements; smaller than the full send
  (``2 n``) while ``k / n < 1/3``. Needs ``n < 2**31``.
- ``bitmap``: one bit per element (``ceil(n / 8)`` bytes, set where the bits changed, packed
  little-endian within a byte as ``numpy.packbits(bitorder="little")``) and the new bit patterns of
  the set elements in index order: ``ceil(n / 8) + 2 k`` bytes; smaller than the full send while
  ``k / n < 15/16``.
- ``xor_zlib``: the XOR of old and new bit patterns, zlib-compressed at level 1: no fixed size, as
  small as the XOR is compressible.

Measurement code, not a transport: nothing here runs in the trainer.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

ENCODINGS = ("positions", "bitmap", "xor_zlib")


@dataclass(frozen=True)
class Delta:
    """One tensor's update in one encoding."""

    encoding: str
    numel: int
    """Elements of the tensor (``n``)."""
    parts: tuple[bytes | torch.Tensor, ...]
    """``positions``: (indices int32 [k], values int16 [k]); ``bitmap``: (mask uint8 [ceil(n/8)],
    values int16 [k]); ``xor_zlib``: (zlib bytes,)."""

    @property
    def num_bytes(self) -> int:
        return sum(len(p) if isinstance(p, bytes) else p.numel() * p.element_size() for p in self.parts)


def bf16_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` cast to bf16 (round to nearest even, what ``Tensor.to`` does), as flat int16 bits."""
    return t.detach().to(torch.bfloat16).reshape(-1).view(torch.int16)


def _check(prev: torch.Tensor, new: torch.Tensor) -> None:
    if prev.dtype != torch.int16 or new.dtype != torch.int16 or prev.shape != new.shape or prev.dim() != 1:
        raise ValueError(
            f"expected two flat int16 tensors of one shape, got {prev.dtype}{tuple(prev.shape)} "
            f"and {new.dtype}{tuple(new.shape)}"
        )


def encode_positions(prev: torch.Tensor, new: torch.Tensor) -> Delta:
    _check(prev, new)
    if new.numel() >= 2**31:
        raise ValueError(f"{new.numel()} elements do not fit int32 positions")
    index = torch.nonzero(prev != new).reshape(-1)
    return Delta("positions", new.numel(), (index.to(torch.int32), new[index]))


def encode_bitmap(prev: torch.Tensor, new: torch.Tensor) -> Delta:
    _check(prev, new)
    changed = prev != new
    mask = np.packbits(changed.numpy(), bitorder="little")
    return Delta("bitmap", new.numel(), (torch.from_numpy(mask), new[changed]))


def encode_xor_zlib(prev: torch.Tensor, new: torch.Tensor) -> Delta:
    _check(prev, new)
    xor = torch.bitwise_xor(prev, new)
    return Delta("xor_zlib", new.numel(), (zlib.compress(xor.numpy().tobytes(), 1),))


ENCODERS = {"positions": encode_positions, "bitmap": encode_bitmap, "xor_zlib": encode_xor_zlib}


def decode(prev: torch.Tensor, delta: Delta) -> torch.Tensor:
    """``prev`` (flat int16 bf16 bits) with ``delta`` applied, as a new tensor."""
    if prev.numel() != delta.numel:
        raise ValueError(f"delta of {delta.numel} elements applied to a tensor of {prev.numel()}")
    out = prev.clone()
    if delta.encoding == "positions":
        index, values = delta.parts
        out[index.to(torch.int64)] = values
    elif delta.encoding == "bitmap":
        mask, values = delta.parts
        changed = np.unpackbits(mask.numpy(), count=delta.numel, bitorder="little").view(np.bool_)
        out[torch.from_numpy(changed)] = values
    elif delta.encoding == "xor_zlib":
        xor = np.frombuffer(zlib.decompress(delta.parts[0]), dtype=np.int16)
        out ^= torch.from_numpy(xor.copy())
    else:
        raise ValueError(f"unknown encoding {delta.encoding!r}; known: {ENCODINGS}")
    return out
