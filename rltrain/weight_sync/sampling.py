"""Which weights one sync's verification reads: chosen from the sync index alone, so that checking
costs a small fraction of the sync while every tensor is checked within a few syncs.

Contract (pure; torch and hashlib only):
- ``verify_mode(value)``: ``rollout.weight_sync.verify_checksums`` as one of ``VERIFY_MODES``
  (``true`` is ``full``, ``false`` is ``off``).
- ``digest_request(names, sync_index=k, every=N, mode=..., first=...)``: the ``DigestRequest`` of
  sync ``k`` over the HF tensors ``names`` in export order. ``full``: every tensor, whole.
  ``sampled``: a sender's first sync (into a new engine: the run's start, or a restart's; ``first``,
  by default ``k == 0``) every tensor whole; a later one the tensors of the vLLM modules whose
  position ``i`` (modules in the export order of their first tensor, ``ModuleRotation``) has
  ``i % N == k % N``, each on ``COLUMNS_PER_TENSOR`` columns of its last dimension. So every tensor
  is checked within any ``N`` consecutive syncs, and a fused module (q/k/v, gate/up, a layer's
  experts) is checked at one sync: the engine reads it back once, not once per member. The trainer
  numbers a sync by the training step whose weights it carries, so a resumed run checks at each
  step what the uninterrupted run did.
- ``sample_columns(name, sync_index, width)``: the sampled columns (sorted indices into the last
  dimension of one engine worker's shard of ``name``, ``width`` wide), seeded by the vLLM module
  ``name`` loads into (``fused_group``) and the sync index. Seeding by the module, not the tensor,
  gives q/k/v (and gate/up) the same input columns, so the engine reads a fused, prepacked linear
  layer back once, through the selected rows of the identity (``rltrain.rollout.vllm.checksum``).
Why columns of the last dimension: that is the input dimension of a linear weight ``[out, in]``,
the one a GEMM with rows of the identity selects; an embedding or a norm is indexed directly.
The trainer computes the request (it knows the export order) and sends it with the digest call;
trainer and engine then both derive the columns from it with ``sample_columns``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_bridge.vllm_names import fused_group

VERIFY_MODES = ("sampled", "full", "off")
COLUMNS_PER_TENSOR = 8
"""Columns of the last dimension a sampled tensor is checked on (whole when it has no more)."""


def verify_mode(value: str | bool) -> str:
    """``rollout.weight_sync.verify_checksums`` as one of ``VERIFY_MODES`` (true: full, false: off)."""
    if isinstance(value, bool):
        return "full" if value else "off"
    if value not in VERIFY_MODES:
        raise ValueError(
            f"rollout.weight_sync.verify_checksums={value!r} is not one of {', '.join(VERIFY_MODES)}"
        )
    return value


@dataclass(frozen=True)
class DigestRequest:
    """What the engine reads back after one sync (and the trainer digests while sending it)."""

    sync_index: int
    """Which sync this is (0 for the first): seeds the sampled columns."""
    tensors: dict[str, bool]
    """``{hf_name: sampled}``: the tensors checked; ``False`` reads the whole worker shard,
    ``True`` the columns ``sample_columns`` picks."""
    skip_unsupported: bool = False
    """Skip modules the engine cannot read back (fused MoE other than GPT-OSS's stacked experts on
    CPU) instead of raising; the default sampled mode must not stop a run that full mode refuses."""

    def columns(self, name: str, width: int) -> list[int] | None:
        """The columns of ``name`` (last dimension ``width`` wide) to digest; None: all of them."""
        return sample_columns(name, self.sync_index, width) if self.tensors.get(name) else None

    def columns_of(self, name: str, tensor: torch.Tensor) -> list[int] | None:
        """``columns`` for ``tensor``, one worker's shard of ``name``."""
        return self.columns(name, last_width(tensor))


def sample_columns(name: str, sync_index: int, width: int, count: int = COLUMNS_PER_TENSOR) -> list[int]:
    """``count`` sorted column indices in ``range(width)`` (all when ``width <= count``), the same for
    every tensor of one vLLM module at one sync."""
    if width <= count:
        return list(range(width))
    group, chosen, draw = fused_group(name), set(), 0
    while len(chosen) < count:  # SHA-256 as the generator: the same in every process, and cheap
        digest = hashlib.sha256(f"{group}:{sync_index}:{draw}".encode()).digest()
        chosen.add(int.from_bytes(digest[:8], "little") % width)
        draw += 1
    return sorted(chosen)


def checked(position: int, *, sync_index: int, every: int, mode: str, first: bool) -> bool | None:
    """How sync ``sync_index`` (``first``: the sender's first) checks a tensor at rotation
    ``position``: None not at all, False whole, True on sampled columns (see the module docstring)."""
    if mode == "full" or (mode == "sampled" and first):
        return False
    if mode != "sampled":
        raise ValueError(f"nothing is checked in verify mode {mode!r}")
    return True if position % every == sync_index % every else None


class ModuleRotation:
    """The rotation position of each tensor: that of its vLLM module (``fused_group``), modules
    numbered in the order their first tensor comes (fed the export order, every rank agrees)."""

    def __init__(self) -> None:
        self._positions: dict[str, int] = {}

    def position(self, name: str) -> int:
        return self._positions.setdefault(fused_group(name), len(self._positions))


def digest_request(
    names: Sequence[str], *, sync_index: int, every: int, mode: str, first: bool | None = None
) -> DigestRequest:
    """Sync ``sync_index``'s request over ``names`` (export order); see the module docstring."""
    tensors, rotation = {}, ModuleRotation()
    first = sync_index == 0 if first is None else first
    for name in names:
        sampled = checked(rotation.position(name), sync_index=sync_index, every=every, mode=mode, first=first)
        if sampled is not None:
            tensors[name] = sampled
    return DigestRequest(sync_index, tensors, skip_unsupported=mode == "sampled")


def last_width(tensor: torch.Tensor) -> int:
    """The size of ``tensor``'s last dimension (1 for a scalar)."""
    return tensor.shape[-1] if tensor.dim() else 1


def take_columns(tensor: torch.Tensor, columns: list[int] | None) -> torch.Tensor:
    """``tensor[..., columns]`` (the tensor itself for None, or a scalar)."""
    if columns is None or tensor.dim() == 0:
        return tensor
    return tensor[..., torch.tensor(columns, dtype=torch.long, device=tensor.device)]
