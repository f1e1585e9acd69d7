"""Broadcast transport: trainer rank 0 sends the whole HF tensors in buckets over a process group to
engines on other devices (``rollout.mode: separate``).

Wire format: one process group holds the sender (group rank ``src_rank``) and the engine-side
receivers (gloo on CPU, NCCL on GPU; ``standalone_group`` builds one that does not collide with the
engine's own torch.distributed state). Per bucket the sender broadcasts the bucket's metadata, then
one flat uint8 buffer; an empty metadata message ends the stream. Buckets never split a fused
module (``buckets.iter_buckets``), so each one is a complete engine call: the receiver hands it to
``engine.receive`` before the next bucket arrives, and both ends reuse their flat buffers
(``buckets.BufferPool``) from one bucket and one sync to the next. No disk anywhere.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_bridge.reshard import EngineLayout
from rltrain.weight_sync.buckets import (
    BufferPool,
    PackedBucket,
    TensorMeta,
    iter_buckets,
    pack_bucket,
    unpack_bucket,
)
from rltrain.weight_sync.types import EngineReceiver, SyncStats, TensorRegions, WeightSource, drain


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
    """One end of the broadcast: the sender (group rank ``src_rank``, ``send``), a receiver
    (``receive``), or a trainer rank outside the group (``group=None``: it serves its slices to
    trainer rank 0 and sends nothing itself). Every group member builds it with the same
    ``bucket_bytes``; ``device`` holds the flat buffers (cpu for gloo, the local cuda device for NCCL).
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup | None,
        src_rank: int,
        bucket_bytes: int,
        device: torch.device | str = "cpu",
        rank: int = 0,
    ) -> None:
        self.group, self.src_rank, self.bucket_bytes = group, src_rank, bucket_bytes
        self.device = torch.device(device)
        self.rank = rank
        """This process's trainer rank (the sender's trainer rank is 0), for ``send``."""
        self._pool = BufferPool(device=self.device)

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

    def send(self, source: WeightSource) -> SyncStats | None:
        """Collective over the trainer's ranks: rank 0 receives the whole tensors and broadcasts
        every bucket, then the end marker; the other trainer ranks serve their slices."""
        updates = source.regions(EngineLayout(tp=1), dst=0)
        if self.group is None:
            drain(updates)
            return None
        if self.group.rank() != self.src_rank:
            raise RuntimeError(f"send() on group rank {self.group.rank()}; the sender is {self.src_rank}")
        start = time.perf_counter()
        num_tensors = num_bytes = num_buckets = 0
        whole = ((u.name, u.full(0)) for u in updates)
        for bucket in iter_buckets(whole, self.bucket_bytes):
            packed = pack_bucket(bucket, device=self.device, pool=self._pool)
            metas = [(m.name, m.shape, str(m.dtype), m.offset) for m in packed.metas]
            self._broadcast_meta([metas, packed.flat.numel()])
            self._broadcast(packed.flat)
            num_tensors += len(bucket)
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            num_buckets += 1
        self._broadcast_meta(None)
        return SyncStats(num_tensors, num_bytes, num_buckets, time.perf_counter() - start)

    def receive_buckets(self):
        """On a receiver: each bucket as it arrives (views into a reused buffer: take a bucket in
        before asking for the next), until the end marker."""
        if self.group is None or self.group.rank() == self.src_rank:
            raise RuntimeError("receive_buckets() is for the receivers of the broadcast group")
        while True:
            message = self._broadcast_meta(None)
            if message is None:
                return
            raw_metas, num_bytes = message
            flat = self._pool.take(num_bytes)
            self._broadcast(flat)
            metas = [TensorMeta(n, tuple(s), _dtype_from_name(d), o) for n, s, d, o in raw_metas]
            yield PackedBucket(metas, flat)

    def receive(self, engine: EngineReceiver) -> SyncStats:
        """On a receiver holding an engine: load every bucket into it as it arrives."""
        return load_buckets(engine, self.receive_buckets(), bucket_bytes=self.bucket_bytes)


def load_buckets(engine: EngineReceiver, buckets: Iterable[PackedBucket], *, bucket_bytes: int) -> SyncStats:
    """Hand each packed bucket to ``engine.receive`` (every engine worker reads the whole tensors);
    the receive path of the broadcast transport after the network hop (the wait for each bucket
    counts in ``seconds``: ``buckets`` may be the live receiver)."""
    start = time.perf_counter()
    loads = [
        engine.receive(
            [TensorRegions.whole(n, t, engine.num_workers) for n, t in unpack_bucket(packed)],
            bucket_bytes=bucket_bytes,
        )
        for packed in buckets
    ]
    return SyncStats.of_loads(loads, time.perf_counter() - start)


def join_broadcast_group(
    address: tuple[str, int], *, group_rank: int, world_size: int, timeout_s: float = 600.0
) -> tuple[dist.ProcessGroup, torch.device]:
    """The broadcast group at ``address`` (trainer rank 0 is group rank 0 and hosts its store) and
    the device its buffers live on: NCCL and the current CUDA device where CUDA is present, else
    gloo and the CPU."""
    cuda = torch.cuda.is_available()
    group = standalone_group(
        host=address[0],
        port=address[1],
        rank=group_rank,
        world_size=world_size,
        backend="nccl" if cuda else "gloo",
        timeout_s=timeout_s,
    )
    return group, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
