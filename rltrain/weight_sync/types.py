"""What crosses between the trainer's sender, a transport and an engine: plain data and two protocols.

- ``TensorRegions``: one HF tensor for one engine, as each engine worker (TP rank) reads it.
- ``SyncStats``: what one sync moved.
- ``WeightSource``: anything that yields an engine layout's ``TensorRegions`` on one rank
  (``PlannedExport`` of a Megatron model; ``TensorSource`` of full tensors).
- ``EngineReceiver``: the engine side (``receive`` of ``rltrain.rollout.protocol.RolloutEngine``).
Pure torch; no process groups, no vLLM, no Megatron.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from megatron_bridge.reshard import EngineLayout

NamedTensor = tuple[str, torch.Tensor]
Region = tuple[tuple[slice, ...], torch.Tensor]
"""A region in full HF coordinates and its values."""


@dataclass
class TensorRegions:
    """One HF tensor for an engine: its full shape and, per engine worker (TP rank), what it reads."""

    name: str
    """HF name, as vLLM's loader accepts it."""
    shape: tuple[int, ...]
    """Full (unpadded) HF shape."""
    regions: dict[int, list[Region]]
    """``{worker: [(slices in full coordinates, values)]}``: the planned regions of each worker."""
    senders: dict[int, list[int]] = field(default_factory=dict)
    """``{worker: [trainer rank]}``: who sent each worker's regions (empty: the receiving rank)."""

    @classmethod
    def whole(cls, name: str, tensor: torch.Tensor, num_workers: int = 1) -> TensorRegions:
        """Every worker reads the whole tensor (vLLM's loader narrows it on each worker)."""
        full = tuple(slice(0, s) for s in tensor.shape)
        return cls(name, tuple(tensor.shape), {w: [(full, tensor)] for w in range(num_workers)})

    def full(self, worker: int) -> torch.Tensor:
        """The full-shaped tensor ``worker`` loads: its region itself when that covers the whole
        tensor (no copy), else a new tensor with its regions filled and the rest uninitialized
        (never read: vLLM's loader narrows to the worker's part)."""
        regions = self.regions[worker]
        if len(regions) == 1 and tuple(regions[0][1].shape) == self.shape:
            return regions[0][1]
        first = regions[0][1]
        out = torch.empty(self.shape, dtype=first.dtype, device=first.device)
        for slices, values in regions:
            out[slices] = values
        return out

    def shard(self, worker: int) -> torch.Tensor:
        """Just the part ``worker`` reads (the bounding box of its regions): its local shard, as
        vLLM's loader narrows the full tensor there (what its weight readback reports)."""
        regions = self.regions[worker]
        if len(regions) == 1:
            return regions[0][1].contiguous()
        box = list(regions[0][0])
        for slices, _ in regions[1:]:
            box = [slice(min(b.start, s.start), max(b.stop, s.stop)) for b, s in zip(box, slices)]
        first = regions[0][1]
        out = torch.empty([b.stop - b.start for b in box], dtype=first.dtype, device=first.device)
        for slices, values in regions:
            out[tuple(slice(s.start - b.start, s.stop - b.start) for s, b in zip(slices, box))] = values
        return out

    @property
    def num_bytes(self) -> int:
        """Bytes of every region of every worker (a region shared by several workers counts once)."""
        seen: dict[int, int] = {}
        for regions in self.regions.values():
            for _, values in regions:
                seen[id(values)] = values.numel() * values.element_size()
        return sum(seen.values())


@dataclass(frozen=True)
class SyncStats:
    """What one weight sync moved, seen from the side that reports it."""

    num_tensors: int
    """HF tensors moved."""
    num_bytes: int
    """Payload bytes (padding between packed tensors excluded)."""
    num_buckets: int
    """Buckets sent or received (1 for an unbucketed stream)."""
    seconds: float
    """Wall time, including the engine's load and prefix-cache reset where it applies."""
    path: str = ""
    """How the engine (its worker rank 0) took the weights in: ``direct`` or ``reload``."""

    @classmethod
    def of_loads(cls, loads: list[SyncStats], seconds: float) -> SyncStats:
        """Several engine loads (one per bucket) as one sync that took ``seconds``."""
        return cls(
            num_tensors=sum(s.num_tensors for s in loads),
            num_bytes=sum(s.num_bytes for s in loads),
            num_buckets=len(loads),
            seconds=seconds,
            path=loads[0].path if loads else "",
        )

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / max(self.seconds, 1e-12) / 1e9


class WeightSource(Protocol):
    """Collective over the trainer's ranks: every rank iterates ``regions`` to the end."""

    def regions(self, engine: EngineLayout, *, dst: int) -> Iterator[TensorRegions]:
        """On global rank ``dst``: every HF tensor with each engine rank's planned regions."""
        ...


class EngineReceiver(Protocol):
    """An engine that takes weights in place (the part of ``rltrain.rollout.protocol.RolloutEngine``
    weight sync uses)."""

    num_workers: int
    """Its TP workers (the keys of ``TensorRegions.regions``)."""

    def receive(self, updates: Iterable[TensorRegions], *, bucket_bytes: int) -> SyncStats:
        """Load ``updates`` (each module complete in one call), then reset the prefix cache."""
        ...

    def all_weights_digests(self, request: Any = None) -> list[dict[str, str]]:
        """Per worker: ``{hf_name: sha256}`` of what ``request`` (a ``sampling.DigestRequest``;
        None: everything, whole) names of its effective weights."""
        ...


class TensorSource:
    """A ``WeightSource`` of full HF tensors on one process (tests, benches, engines fed by a
    receiver): every engine worker reads each whole tensor."""

    def __init__(self, named_tensors: Iterable[NamedTensor] | dict[str, torch.Tensor]) -> None:
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        self.named_tensors = list(items)

    def regions(self, engine: EngineLayout, *, dst: int = 0) -> Iterator[TensorRegions]:
        for name, tensor in self.named_tensors:
            yield TensorRegions.whole(name, tensor, engine.tp)


def drain(stream: Iterable[Any]) -> None:
    """Run a collective generator to its end on a rank that receives nothing from it."""
    for _ in stream:
        pass
