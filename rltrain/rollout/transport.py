"""Weight transports: how HF-named trainer tensors reach a rollout engine, behind one small interface.

- ``InProcessTransport`` (colocated: engine in the trainer's process, or its workers on the same
  GPUs): the trainer's iterator goes straight to ``RolloutEngine.load_weights``, which streams it
  through one reload call in-process, or hands group-aligned buckets to worker processes (CUDA IPC
  handles on GPU). No copy of the stream is made here.
- ``BroadcastTransport`` (engine on other devices): one process group holds the trainer rank that
  sends and the engine-side ranks that receive (gloo on CPU, NCCL on GPU; ``standalone_group``
  builds one that does not collide with the engine's own torch.distributed state). Per bucket the sender broadcasts the bucket's metadata, then
  one flat uint8 buffer; an empty metadata message ends the stream. Receivers rebuild views into a
  fresh buffer per bucket (vLLM's layerwise reload may hold tensors until a module is complete, so
  buffers are never reused) and feed them to ``load_weights`` as they arrive.
Buckets never split a fused module (see ``bucketing``). No disk anywhere.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rltrain.rollout.bucketing import (
    NamedTensor,
    PackedBucket,
    TensorMeta,
    iter_buckets,
    pack_bucket,
    unpack_bucket,
)


@dataclass(frozen=True)
class SyncStats:
    """What one weight sync moved, seen from the side that reports it."""

    num_tensors: int
    """HF tensors moved."""
    num_bytes: int
    """Payload bytes (padding between packed tensors excluded)."""
    num_buckets: int
    """Buckets sent or received (1 for an in-process stream)."""
    seconds: float
    """Wall time of the sync, including the engine's load and prefix-cache reset where it applies."""

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / max(self.seconds, 1e-12) / 1e9


class WeightTransport(Protocol):
    """The trainer-side verb: push a full or partial set of HF-named tensors to the engine(s)."""

    def send(self, named_tensors: Iterable[NamedTensor]) -> SyncStats: ...


class InProcessTransport:
    """Colocated engine: hand the stream to the engine itself."""

    def __init__(self, engine: Any, *, bucket_bytes: int) -> None:
        self.engine = engine
        self.bucket_bytes = bucket_bytes

    def send(self, named_tensors: Iterable[NamedTensor]) -> SyncStats:
        start = time.perf_counter()
        load = self.engine.load_weights(named_tensors, bucket_bytes=self.bucket_bytes)
        return SyncStats(load.num_tensors, load.num_bytes, 1, time.perf_counter() - start)


def standalone_group(
    *, host: str, port: int, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 600.0
) -> dist.ProcessGroup:
    """A process group of its own TCP store, not registered as torch.distributed's default group.

    An in-process vLLM engine initializes torch.distributed for its own workers, and its group
    creation is collective over the default group: a default group that spans trainer and engine
    ranks deadlocks there. This group stays out of its way. Rank 0 hosts the store.
    """
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(f"rltrain_weight_sync_{backend}", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, world_size)
    raise ValueError(f"standalone_group: backend must be 'gloo' or 'nccl', got {backend!r}")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"bucket metadata names an unknown dtype {name!r}")
    return dtype


class BroadcastTransport:
    """Sender and receivers of one process group; every member constructs it with the same arguments.

    ``group`` is any ``ProcessGroup`` object (a registered one, or ``standalone_group``); ``src_rank``
    is the sender's rank *in that group*; ``device`` holds the flat buffers (cpu for gloo, the local
    cuda device for NCCL).
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup,
        src_rank: int,
        bucket_bytes: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.group = group
        self.src_rank = src_rank
        self.bucket_bytes = bucket_bytes
        self.device = torch.device(device)
        self.buckets_received = 0
        """Buckets taken by the last ``receive_iter`` on this rank."""

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = self.src_rank
        self.group.broadcast([tensor], options).wait()

    def _broadcast_meta(self, meta: Any) -> Any:
        """Pickled metadata: its length, then its bytes; length 0 is the end marker (None)."""
        is_src = self.group.rank() == self.src_rank
        payload = pickle.dumps(meta) if is_src and meta is not None else b""
        length = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self._broadcast(length)
        if int(length.item()) == 0:
            return None
        buf = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
            if is_src
            else torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        )
        self._broadcast(buf)
        return meta if is_src else pickle.loads(buf.cpu().numpy().tobytes())

    def send(self, named_tensors: Iterable[NamedTensor]) -> SyncStats:
        """On the sender: broadcast every bucket, then the end marker."""
        if self.group.rank() != self.src_rank:
            raise RuntimeError(
                f"send() called on group rank {self.group.rank()}; the sender is {self.src_rank}"
            )
        start = time.perf_counter()
        num_tensors = num_bytes = num_buckets = 0
        for bucket in iter_buckets(named_tensors, self.bucket_bytes):
            packed = pack_bucket(bucket, device=self.device)
            metas = [(m.name, m.shape, str(m.dtype), m.offset) for m in packed.metas]
            self._broadcast_meta([metas, packed.flat.numel()])
            self._broadcast(packed.flat)
            num_tensors += len(bucket)
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            num_buckets += 1
        self._broadcast_meta(None)
        return SyncStats(num_tensors, num_bytes, num_buckets, time.perf_counter() - start)

    def receive_iter(self) -> Iterator[NamedTensor]:
        """On a receiver: yield the sender's tensors bucket by bucket until the end marker."""
        if self.group.rank() == self.src_rank:
            raise RuntimeError(f"receive_iter() called on the sender (group rank {self.src_rank})")
        self.buckets_received = 0
        while True:
            message = self._broadcast_meta(None)
            if message is None:
                return
            raw_metas, num_bytes = message
            flat = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
            self._broadcast(flat)
            metas = [TensorMeta(n, tuple(s), _dtype_from_name(d), o) for n, s, d, o in raw_metas]
            self.buckets_received += 1
            yield from unpack_bucket(PackedBucket(metas, flat))

    def receive(self, engine: Any) -> SyncStats:
        """On a receiver holding an engine: load the whole stream into it (then its prefix cache resets)."""
        start = time.perf_counter()
        load = engine.load_weights(self.receive_iter(), bucket_bytes=self.bucket_bytes)
        return SyncStats(load.num_tensors, load.num_bytes, self.buckets_received, time.perf_counter() - start)


def make_transport(
    kind: str,
    *,
    bucket_bytes: int,
    engine: Any | None = None,
    group: dist.ProcessGroup | None = None,
    src_rank: int = 0,
) -> InProcessTransport | BroadcastTransport:
    """The transport ``weight_sync.transport`` names (``auto``, ``in_process``, ``cuda_ipc``, ``broadcast``).

    ``auto`` is in-process when this process drives the engine (``engine`` given), broadcast otherwise.
    ``cuda_ipc`` is the in-process transport of a GPU engine whose workers run in other processes (the
    engine then ships each bucket by CUDA IPC handle); it is refused for an engine it would not reach so.
    """
    if kind == "auto":
        kind = "in_process" if engine is not None else "broadcast"
    if kind in ("in_process", "cuda_ipc"):
        if engine is None:
            raise ValueError(
                f"weight_sync.transport={kind!r} needs the engine in this process; none was given"
            )
        if kind == "cuda_ipc" and (engine.in_process or not engine.on_gpu):
            raise ValueError(
                "weight_sync.transport='cuda_ipc' needs a GPU engine with workers in other processes "
                f"(this one: on_gpu={engine.on_gpu}, in_process={engine.in_process}); use 'in_process'"
            )
        return InProcessTransport(engine, bucket_bytes=bucket_bytes)
    if kind == "broadcast":
        if group is None:
            raise ValueError("weight_sync.transport='broadcast' needs a process group (see standalone_group)")
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        return BroadcastTransport(group=group, src_rank=src_rank, bucket_bytes=bucket_bytes, device=device)
    raise ValueError(
        f"weight_sync.transport={kind!r} is not one of 'auto', 'in_process', 'cuda_ipc', 'broadcast'"
    )
