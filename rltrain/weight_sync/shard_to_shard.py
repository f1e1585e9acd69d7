"""Shard-to-shard transport (``rollout.weight_sync.transport: shard_to_shard``; ``auto`` with
``rollout.mode: separate``): every trainer rank sends the planned slices it owns straight to every
engine on other devices; no rank gathers a tensor it does not own.

Wire format: one process group, formed once per run, holds every trainer rank (group rank = trainer
rank) and every engine's receiver (group rank = trainer world size + engine index); gloo on CPU,
NCCL on GPU (``broadcast.join_broadcast_group``). What moves is fixed by a ``Schedule`` built from
the reshard plan (``PlannedExport.schedule``): the engine layout's planned slices in export order,
cut into buckets that never split a fused module (``buckets.iter_buckets``), and in each bucket
one message per owning trainer rank holding its slices packed in order. Trainer rank 0 sends the
schedule (pickled) to each engine before its first sync; after that only weights travel: per
bucket, each owner packs its slices once into a reused buffer and sends it to engine 0 (``fanout:
relay``, the default: engine k passes each message on to engine k + 1 as it arrives, a chain) or
to every engine (``direct``: the owners' links carry one copy per engine); each engine receives
the bucket's messages, then hands the bucket (every worker its own regions) to the same
``engine.receive`` as every transport. An engine posts the receives of the next bucket before it
loads the current one, so the network and the load overlap.

Memory beyond the weights (``Schedule.extra_bytes``, the bound the tests hold each rank to): a
trainer rank one packed message (its largest in any bucket); an engine two buckets (the one being
loaded, or passed on, and the one arriving).
"""

from __future__ import annotations

import functools
import math
import pickle
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rltrain.weight_sync.buckets import BufferPool, iter_buckets
from rltrain.weight_sync.types import EngineReceiver, SyncStats, TensorRegions

FANOUTS = ("relay", "direct")
"""How the engines' copies leave the trainer: ``relay`` (owners send to engine 0, engine k passes
each message on to engine k + 1) or ``direct`` (owners send to every engine)."""

_SCHEDULE_TAG = 1
"""Tag of the schedule messages; each bucket's messages are tagged by their bucket index + 2."""


def _wait(work: Any, what: str) -> None:
    """Wait for one send or receive of the weights' group; its timeout (``trainer.timeouts.
    collective_s``) or a lost peer is raised naming what was waited for."""
    try:
        work.wait()
    except RuntimeError as e:
        raise RuntimeError(f"weight sync (shard_to_shard): {what} failed: {str(e).splitlines()[0]}") from e


@dataclass(frozen=True)
class Slot:
    """One planned slice: trainer rank ``owner``'s piece of HF tensor ``name`` at ``src``, which
    engine worker ``worker`` reads at ``dst`` (full HF coordinates)."""

    name: str
    worker: int
    owner: int
    src: tuple[slice, ...]
    dst: tuple[slice, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.dst)


@dataclass
class Bucket:
    """HF tensors loaded in one ``engine.receive`` call, and the slots that fill them, by owner."""

    tensors: list[tuple[str, tuple[int, ...], torch.dtype]]
    """(name, full shape, dtype) in export order."""
    slots: dict[int, list[Slot]] = field(default_factory=dict)
    """``{owner: its slots}`` in the order its message packs them."""

    @functools.cached_property
    def dtypes(self) -> dict[str, torch.dtype]:
        return {name: dtype for name, _, dtype in self.tensors}

    def message_bytes(self, owner: int) -> int:
        return sum(math.prod(s.shape) * self.dtypes[s.name].itemsize for s in self.slots.get(owner, ()))

    @property
    def num_bytes(self) -> int:
        return sum(self.message_bytes(owner) for owner in self.slots)


@dataclass
class Schedule:
    """Every sync's messages, the same on every member of the group (see the module docstring)."""

    buckets: list[Bucket]
    num_trainer_ranks: int

    @classmethod
    def build(
        cls,
        copies: Sequence[tuple[Slot, tuple[int, ...], torch.dtype]],
        *,
        bucket_bytes: int,
        num_trainer_ranks: int,
    ) -> Schedule:
        """From the planned ``(slot, full shape, dtype)`` in export order (a tensor's slots adjacent)."""
        by_tensor: dict[str, list[Slot]] = {}
        meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for slot, shape, dtype in copies:
            by_tensor.setdefault(slot.name, []).append(slot)
            meta[slot.name] = (shape, dtype)

        def weigh(slots: list[Slot]) -> int:
            return sum(math.prod(s.shape) for s in slots) * meta[slots[0].name][1].itemsize

        buckets = []
        for group in iter_buckets(by_tensor.items(), bucket_bytes, weigh=weigh):
            bucket = Bucket([(name, *meta[name]) for name, _ in group])
            for _, slots in group:
                for slot in slots:
                    bucket.slots.setdefault(slot.owner, []).append(slot)
            buckets.append(bucket)
        return cls(buckets, num_trainer_ranks)

    def sent_bytes(self, owner: int) -> int:
        """Bytes trainer rank ``owner`` sends each engine per sync."""
        return sum(b.message_bytes(owner) for b in self.buckets)

    @property
    def num_bytes(self) -> int:
        """Bytes each engine receives per sync."""
        return sum(b.num_bytes for b in self.buckets)

    def extra_bytes(self, member: str, owner: int = 0) -> int:
        """The bound on a member's buffers: ``"trainer"`` rank ``owner``'s largest message, or an
        ``"engine"``'s two largest buckets."""
        if member == "trainer":
            return max((b.message_bytes(owner) for b in self.buckets), default=0)
        sizes = sorted((b.num_bytes for b in self.buckets), reverse=True)
        return sum(sizes[:2])


class _Pool(BufferPool):
    """A ``BufferPool`` that records the bytes of the buffers it holds (its high-water mark)."""

    def held_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers if b is not None)


def _views(flat: torch.Tensor, slots: list[Slot], dtypes: dict[str, torch.dtype]) -> Iterator[torch.Tensor]:
    offset = 0
    for slot in slots:
        dtype = dtypes[slot.name]
        nbytes = math.prod(slot.shape) * dtype.itemsize
        yield flat[offset : offset + nbytes].view(dtype).view(slot.shape)
        offset += nbytes


class ShardToShardSender:
    """The trainer end (every trainer rank; ``group`` spans trainer ranks and engines)."""

    def __init__(
        self,
        *,
        group: Any,
        rank: int,
        num_engines: int,
        engine: Any,
        bucket_bytes: int,
        device: Any = "cpu",
        fanout: str = "relay",
    ) -> None:
        if fanout not in FANOUTS:
            raise ValueError(f"rollout.weight_sync.fanout={fanout!r} is not one of {', '.join(FANOUTS)}")
        self.group, self.rank, self.num_engines, self.fanout = group, rank, num_engines, fanout
        self.engine_layout, self.bucket_bytes = engine, bucket_bytes
        self.device = torch.device(device)
        self._pool = _Pool(device=self.device)
        self._sent_schedule = False
        self.last_sent_bytes = 0
        """Bytes this rank sent at the last sync (to every engine it sends to)."""
        self.peak_extra_bytes = 0
        """The largest its send buffer grew (``Schedule.extra_bytes("trainer", rank)`` bounds it)."""

    def send(self, source: Any) -> SyncStats | None:
        """Collective over the trainer's ranks; the stats on rank 0 (``num_bytes``: what every
        trainer rank sent, together: one copy of the planned bytes with relay, one per engine with
        direct fan-out)."""
        start = time.perf_counter()
        schedule = source.schedule(self.engine_layout, bucket_bytes=self.bucket_bytes)
        if self.group is None:
            raise RuntimeError(
                f"trainer rank {self.rank} is not in the weights' group of the separate engines"
            )
        engines = [schedule.num_trainer_ranks + e for e in range(self.num_engines)]
        targets = engines if self.fanout == "direct" else engines[:1]  # relay: engine 0 passes it on
        if not self._sent_schedule and self.rank == 0:
            message = (schedule, self.fanout, self.num_engines)
            payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
            for dst in engines:
                what = f"trainer rank 0 sending the schedule to group rank {dst} (an engine)"
                _wait(self.group.send([length.to(self.device)], dst, _SCHEDULE_TAG), what)
                _wait(self.group.send([payload.to(self.device)], dst, _SCHEDULE_TAG), what)
        self._sent_schedule = True
        dtypes = {name: dtype for b in schedule.buckets for name, _, dtype in b.tensors}
        sent = 0
        for index, (bucket, values) in enumerate(source.serve(schedule)):
            slots = bucket.slots.get(self.rank, [])
            if not slots:
                continue
            flat = self._pool.take(bucket.message_bytes(self.rank))
            for view, value in zip(_views(flat, slots, dtypes), values):
                view.copy_(value)
            works = [(dst, self.group.send([flat], dst, index + 2)) for dst in targets]
            for dst, work in works:
                _wait(
                    work, f"trainer rank {self.rank} sending bucket {index} to group rank {dst} (an engine)"
                )
            sent += flat.numel() * len(targets)
            self.peak_extra_bytes = max(self.peak_extra_bytes, self._pool.held_bytes())
        self.last_sent_bytes = sent
        if self.rank != 0:
            return None
        return SyncStats(
            num_tensors=sum(len(b.tensors) for b in schedule.buckets),
            num_bytes=schedule.num_bytes * len(targets),  # what the trainer ranks sent, together
            num_buckets=len(schedule.buckets),
            seconds=time.perf_counter() - start,
        )


class ShardToShardReceiver:
    """An engine's end: group rank ``num_trainer_ranks + engine_index``."""

    def __init__(self, *, group: Any, bucket_bytes: int, device: Any = "cpu") -> None:
        self.group, self.bucket_bytes = group, bucket_bytes
        self.device = torch.device(device)
        self.schedule: Schedule | None = None
        self.fanout, self.num_engines = "direct", 1
        """Set with the schedule (trainer rank 0 sends both)."""
        self._pools = (_Pool(device=self.device), _Pool(device=self.device))
        self._forwards: tuple[list[Any], list[Any]] = ([], [])
        """Relay: the sends passing each pool's bucket on to the next engine (done before reuse)."""
        self.peak_extra_bytes = 0
        """What its two bucket buffers grew to (``Schedule.extra_bytes("engine")`` bounds it)."""

    def _receive_schedule(self) -> Schedule:
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        what = f"group rank {self.group.rank()} (an engine) waiting for the schedule from trainer rank 0"
        _wait(self.group.recv([length], 0, _SCHEDULE_TAG), what)
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        _wait(self.group.recv([payload], 0, _SCHEDULE_TAG), what)
        schedule, self.fanout, self.num_engines = pickle.loads(payload.cpu().numpy().tobytes())
        return schedule

    def _relay(self) -> tuple[int | None, int | None]:
        """(whom this engine receives from instead of the owners, whom it forwards to); (None, None)
        with direct fan-out."""
        if self.fanout == "direct" or self.schedule is None:
            return None, None
        me, first = self.group.rank(), self.schedule.num_trainer_ranks
        last = first + self.num_engines - 1
        return (me - 1 if me > first else None), (me + 1 if me < last else None)

    def _post(self, index: int, bucket: Bucket) -> tuple[list[Any], dict[int, torch.Tensor]]:
        """Post the receives of bucket ``index`` into one of the two pools' buffer (one per owner)."""
        pool = self._pools[index % 2]
        for work in self._forwards[index % 2]:  # the bucket before last has left for the next engine
            _wait(work, f"group rank {self.group.rank()} (an engine) passing bucket {index - 2} on")
        self._forwards[index % 2].clear()
        flat = pool.take(bucket.num_bytes)
        source = self._relay()[0]
        messages, works, offset = {}, [], 0
        for owner in bucket.slots:
            nbytes = bucket.message_bytes(owner)
            messages[owner] = flat[offset : offset + nbytes]
            sender = owner if source is None else source
            works.append((sender, self.group.recv([messages[owner]], sender, index + 2)))
            offset += nbytes
        self.peak_extra_bytes = max(self.peak_extra_bytes, sum(p.held_bytes() for p in self._pools))
        return works, messages

    def buckets(self) -> Iterator[list[TensorRegions]]:
        """Each bucket's tensors as they arrive (views into a reused buffer: load a bucket before
        asking for the one after next)."""
        if self.schedule is None:
            self.schedule = self._receive_schedule()
        buckets = self.schedule.buckets
        if not buckets:
            return
        pending = self._post(0, buckets[0])
        forward_to = self._relay()[1]
        for index, bucket in enumerate(buckets):
            works, messages = pending
            for source, work in works:
                _wait(
                    work,
                    f"group rank {self.group.rank()} (an engine) waiting for bucket {index} from group rank {source}",
                )
            if forward_to is not None:  # relay: pass each owner's message on, as it came
                self._forwards[index % 2].extend(
                    self.group.send([messages[owner]], forward_to, index + 2) for owner in bucket.slots
                )
            if index + 1 < len(buckets):  # the next bucket arrives while this one loads
                pending = self._post(index + 1, buckets[index + 1])
            yield self._regions(bucket, messages)

    @staticmethod
    def _regions(bucket: Bucket, messages: dict[int, torch.Tensor]) -> list[TensorRegions]:
        updates = {name: TensorRegions(name, shape, {}) for name, shape, _ in bucket.tensors}
        for owner, slots in bucket.slots.items():
            for slot, view in zip(slots, _views(messages[owner], slots, bucket.dtypes)):
                update = updates[slot.name]
                update.regions.setdefault(slot.worker, []).append((slot.dst, view))
                senders = update.senders.setdefault(slot.worker, [])
                if owner not in senders:
                    senders.append(owner)
        return list(updates.values())

    def receive(self, engine: EngineReceiver) -> SyncStats:
        """Load every bucket into ``engine`` as it arrives (relay: and pass it on to the next engine)."""
        start = time.perf_counter()
        loads = [engine.receive(updates, bucket_bytes=self.bucket_bytes) for updates in self.buckets()]
        for forwards in self._forwards:
            for work in forwards:
                _wait(work, f"group rank {self.group.rank()} (an engine) passing its last buckets on")
            forwards.clear()
        return SyncStats.of_loads(loads, time.perf_counter() - start)


def slots_in_order(
    plan: dict[int, list[Any]], names: Sequence[str], owner_of: Any
) -> Iterator[tuple[int, Any, int]]:
    """``(engine worker, SliceCopy, owner)`` of ``plan`` tensor by tensor in ``names``' order."""
    by_name: dict[str, list[tuple[int, Any]]] = {}
    for worker, copies in plan.items():
        for copy in copies:
            by_name.setdefault(copy.hf_name, []).append((worker, copy))
    for name in names:
        for worker, copy in by_name.get(name, []):
            yield worker, copy, owner_of(copy)
