"""Where the bytes of one live weight sync go, GPU by GPU: the reshard planner's copies placed on a
cluster, for separate trainer and engine nodes, and what each GPU sends, receives and holds.

Pure arithmetic over ``megatron_bridge.reshard`` (no torch, no process groups). Three plans:

- ``shard_to_shard``: every planned slice goes from the trainer GPU that owns it straight to each
  engine GPU that needs it. Engine data-parallel replicas each need a copy, in one of two ways
  (``fanout``): ``"direct"`` (the owner sends its slice once per replica) or ``"relay"`` (the owner
  sends to replica 0; replica ``k`` forwards what it received to the same position of replica
  ``k + 1``, a chain over the replicas). Each vLLM worker receives its own slices: the plan
  rltrain's transport is meant to reach (its receive today is ``shard_to_engine``).
- ``shard_to_engine``: what rltrain's ``shard_to_shard`` transport runs: the owners send straight
  to an engine replica's receiver (its process, on the replica's first GPU), which hands every
  worker its regions; the replicas fed direct or by relay as above, receiver to receiver.
- ``rank0``: the broadcast transport (``rltrain.weight_sync.broadcast``), phase by phase, as its
  code runs them one after the other: *gather* (each owner sends trainer rank 0 its whole-tensor
  slices, one point-to-point message per slice, ``PlannedExport.regions`` at engine TP 1);
  *pack* (rank 0 copies every tensor into ``bucket_bytes`` buckets); *broadcast* (per bucket three
  broadcasts, metadata length, metadata and data, over a group of rank 0 and one receiver per
  engine, modeled as NCCL's pipelined chain: each member but the last forwards every byte it
  receives, in chunks small enough that the chain's fill is left out; one end marker at the close); *hand-off* (each engine's receiver, its GPU 0, gives every
  worker of its engine that worker's regions, one message per bucket per worker).

Placement (``Placement``): Megatron's default rank order, TP fastest, then data parallel, then
pipeline; a dense shard is served by data-parallel replica 0 and an expert shard by expert-data-
parallel replica 0 (what ``PlannedExport`` does), so the owner of ``ShardId(pp, tp, ep)`` is GPU
``pp * tp * dp + tp`` (dense) or ``pp * tp * dp + etp * ep + tp`` (experts, ``tp`` the expert-TP
rank). The engine GPUs start on the first node after the trainer's; replica ``k``, pipeline stage
``s``, TP rank ``t`` is engine GPU ``k * tp * pp + s * tp + t``. Engine pipeline stages split the
decoder layers as vLLM's ``get_pp_indices`` does (the remainder on the stages before the last;
the embedding on the first stage, the final norm and head on the last); each stage is planned by
``reshard.plan_weight_sync`` over that stage's tensors. A link is ``"nvlink"`` between two GPUs of
one node and ``"net"`` between nodes.

Counts: bytes of every planned element at ``dtype_bytes`` each; ``messages``: point-to-point or
collective calls a GPU takes part in (each counts on both ends), slices sent to one destination
packed into messages of at most ``bucket_bytes`` (a slice larger than that is its own message);
``extra``: the largest buffer a GPU holds beyond its weights, as stated per plan in
``rank0`` and ``shard_to_shard``.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from megatron_bridge.reshard import (
    EngineLayout,
    SliceCopy,
    TensorLayout,
    TrainerLayout,
    is_expert,
    plan_weight_sync,
)

LINKS = ("nvlink", "net")


@dataclass(frozen=True)
class Placement:
    """Trainer and engines on separate nodes of ``gpus_per_node`` GPUs."""

    trainer: TrainerLayout
    trainer_dp: int
    """Data-parallel size of dense weights: a pipeline stage spans ``trainer.tp * trainer_dp`` GPUs
    (and ``etp * ep * expert_dp`` for experts, the same GPUs)."""
    engine: EngineLayout
    engine_pp: int = 1
    engine_replicas: int = 1
    """Engine data-parallel replicas, each a whole copy of the weights."""
    gpus_per_node: int = 8
    dtype_bytes: int = 2
    bucket_bytes: int = 512 << 20
    """Largest message (``rollout.weight_sync.bucket_size_mb``'s default, 512 MiB)."""

    @property
    def stage_gpus(self) -> int:
        return self.trainer.tp * self.trainer_dp

    @property
    def trainer_gpus(self) -> int:
        return self.stage_gpus * self.trainer.pp

    @property
    def engine_gpus(self) -> int:
        """GPUs of one engine replica."""
        return self.engine.tp * self.engine_pp

    @property
    def engine_base(self) -> int:
        """Global index of the first engine GPU (the first GPU of the node after the trainer's)."""
        return -(-self.trainer_gpus // self.gpus_per_node) * self.gpus_per_node

    def check(self) -> None:
        etp = self.trainer.etp or self.trainer.tp
        if self.trainer.num_experts and self.stage_gpus % (etp * self.trainer.ep):
            raise ValueError(
                f"expert tp {etp} × ep {self.trainer.ep} does not divide a stage's {self.stage_gpus} GPUs"
            )

    def owner(self, copy: SliceCopy, expert: bool) -> int:
        """Trainer GPU serving ``copy.source`` (replica 0 of its data-parallel group)."""
        base = copy.source.pp * self.stage_gpus
        if expert:
            return base + (self.trainer.etp or self.trainer.tp) * copy.source.ep + copy.source.tp
        return base + copy.source.tp

    def engine_gpu(self, replica: int, stage: int, tp_rank: int) -> int:
        return self.engine_base + replica * self.engine_gpus + stage * self.engine.tp + tp_rank

    def node(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def link(self, a: int, b: int) -> str:
        return "nvlink" if self.node(a) == self.node(b) else "net"


def engine_stage_layers(num_layers: int, pp: int) -> list[range]:
    """Decoder layers of each engine pipeline stage, as vLLM's ``get_pp_indices`` splits them."""
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]


def engine_stage(t: TensorLayout, num_layers: int, pp: int) -> int:
    if t.layer is None:
        return pp - 1 if t.last_stage else 0
    for stage, layers in enumerate(engine_stage_layers(num_layers, pp)):
        if t.layer in layers:
            return stage
    raise ValueError(f"{t.hf_name}: layer {t.layer} is outside {num_layers} layers")


def copy_bytes(copy: SliceCopy, dtype_bytes: int) -> int:
    return math.prod(s.stop - s.start for s in copy.dst) * dtype_bytes


def replica_plan(tensors: list[TensorLayout], place: Placement) -> dict[tuple[int, int], list[SliceCopy]]:
    """``{(engine stage, engine tp rank): copies}`` of one engine replica."""
    by_stage: dict[int, list[TensorLayout]] = defaultdict(list)
    for t in tensors:
        by_stage[engine_stage(t, place.trainer.num_layers, place.engine_pp)].append(t)
    plan = {}
    for stage in range(place.engine_pp):
        for rank, copies in plan_weight_sync(by_stage[stage], place.trainer, place.engine).items():
            plan[(stage, rank)] = copies
    return plan


@dataclass
class GpuTraffic:
    """What one GPU does in one phase of a sync."""

    sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LINKS, 0))
    """Bytes sent, by link class."""
    received: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LINKS, 0))
    messages: int = 0
    """Calls this GPU takes part in (send, receive, or collective)."""
    packed: int = 0
    """Bytes this GPU copies into or out of message buffers."""
    extra: int = 0
    """Largest buffer it holds beyond its weights."""


@dataclass
class Phase:
    """One phase of a plan; the phases of a plan run one after the other."""

    name: str
    gpus: dict[int, GpuTraffic] = field(default_factory=lambda: defaultdict(GpuTraffic))
    pipeline_fill_bytes: int = 0
    """Bytes a chain must carry before its last member starts (the relay forwards whole messages)."""
    pipeline_fill_link: str = "net"
    calls: int = 0
    """Point-to-point messages and collective calls of the phase (each counted once)."""

    def move(self, src: int, dst: int, nbytes: int, link: str, *, messages: int) -> None:
        self.calls += messages
        self.gpus[src].sent[link] += nbytes
        self.gpus[dst].received[link] += nbytes
        self.gpus[src].messages += messages
        self.gpus[dst].messages += messages


@dataclass
class SyncPlan:
    name: str
    phases: list[Phase]
    need: dict[int, int]
    """Bytes each engine GPU must end up with (its regions of every tensor)."""
    position: dict[int, tuple[int, int]]
    """Each engine GPU's (pipeline stage, TP rank) in its replica: equal positions need equal bytes."""


def _messages(nbytes: int, largest_slice: int, bucket: int) -> int:
    return max(1, -(-nbytes // max(bucket, largest_slice)))


def shard_to_shard(
    tensors: list[TensorLayout],
    place: Placement,
    *,
    fanout: str,
    plan: dict[tuple[int, int], list[SliceCopy]] | None = None,
) -> SyncPlan:
    """Owners send each planned slice straight to the engine GPUs (``fanout``: ``"direct"`` or
    ``"relay"``, see the module docstring). Extra memory: a sender packs one message (at most
    ``bucket_bytes``, or its largest slice) at a time, a receiver takes one in at a time; a relaying
    GPU forwards from the weights it loaded. ``plan``: ``replica_plan(tensors, place)`` when the
    caller has it already."""
    if fanout not in ("direct", "relay"):
        raise ValueError(f"fanout must be 'direct' or 'relay', got {fanout!r}")
    place.check()
    layouts = {t.hf_name: t for t in tensors}
    plan = plan if plan is not None else replica_plan(tensors, place)
    # (owner, stage, tp rank) -> [bytes, largest slice]
    flows: dict[tuple[int, int, int], list[int]] = defaultdict(lambda: [0, 0])
    need_by_position: dict[tuple[int, int], int] = {}
    largest_by_position: dict[tuple[int, int], int] = defaultdict(int)
    for (stage, rank), copies in plan.items():
        total = 0
        for c in copies:
            nbytes = copy_bytes(c, place.dtype_bytes)
            flow = flows[(place.owner(c, is_expert(layouts[c.hf_name])), stage, rank)]
            flow[0] += nbytes
            flow[1] = max(flow[1], nbytes)
            largest_by_position[(stage, rank)] = max(largest_by_position[(stage, rank)], nbytes)
            total += nbytes
        need_by_position[(stage, rank)] = total
    phase = Phase(f"shard-to-shard ({fanout})")
    need: dict[int, int] = {}
    position: dict[int, tuple[int, int]] = {}
    bucket = place.bucket_bytes
    for replica in range(place.engine_replicas):
        for (stage, rank), total in need_by_position.items():
            need[place.engine_gpu(replica, stage, rank)] = total
            position[place.engine_gpu(replica, stage, rank)] = (stage, rank)
        if fanout == "direct" or replica == 0:
            for (owner, stage, rank), (nbytes, largest) in flows.items():
                dst = place.engine_gpu(replica, stage, rank)
                msgs = _messages(nbytes, largest, bucket)
                phase.move(owner, dst, nbytes, place.link(owner, dst), messages=msgs)
                for gpu in (owner, dst):
                    phase.gpus[gpu].extra = max(phase.gpus[gpu].extra, min(nbytes, max(bucket, largest)))
                    phase.gpus[gpu].packed += nbytes
        else:
            for (stage, rank), total in need_by_position.items():
                src = place.engine_gpu(replica - 1, stage, rank)
                dst = place.engine_gpu(replica, stage, rank)
                largest = largest_by_position[(stage, rank)]
                msgs = _messages(total, largest, bucket)
                phase.move(src, dst, total, place.link(src, dst), messages=msgs)
                phase.gpus[dst].extra = max(phase.gpus[dst].extra, min(total, max(bucket, largest)))
                phase.gpus[dst].packed += total
    if fanout == "relay" and place.engine_replicas > 1:
        phase.pipeline_fill_bytes = (place.engine_replicas - 1) * min(bucket, max(need.values()))
        phase.pipeline_fill_link = place.link(place.engine_gpu(0, 0, 0), place.engine_gpu(1, 0, 0))
    return SyncPlan(phase.name, [phase], need, position)


def shard_to_engine(
    tensors: list[TensorLayout],
    place: Placement,
    *,
    fanout: str = "relay",
    plan: dict[tuple[int, int], list[SliceCopy]] | None = None,
) -> SyncPlan:
    """What rltrain's ``shard_to_shard`` transport runs today: every owner sends its planned slices
    for all workers of a replica to that replica's receiver (its engine process, on the replica's
    first GPU): to every replica's (``fanout="direct"``), or to replica 0's, each receiver passing
    every message on to the next replica's (``"relay"``); the receiver hands each worker its
    regions (CUDA IPC within a node). Extra memory: a sender one message (at most ``bucket_bytes``
    or its largest slice), a receiver two buckets (one loading or passed on, the next arriving), a
    worker its share of a bucket."""
    if fanout not in ("direct", "relay"):
        raise ValueError(f"fanout must be 'direct' or 'relay', got {fanout!r}")
    place.check()
    layouts = {t.hf_name: t for t in tensors}
    plan = plan if plan is not None else replica_plan(tensors, place)
    flows: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # owner -> [bytes, largest slice]
    need_by_position: dict[tuple[int, int], int] = {}
    for position, copies in plan.items():
        need_by_position[position] = 0
        for c in copies:
            nbytes = copy_bytes(c, place.dtype_bytes)
            flow = flows[place.owner(c, is_expert(layouts[c.hf_name]))]
            flow[0] += nbytes
            flow[1] = max(flow[1], nbytes)
            need_by_position[position] += nbytes
    total = sum(need_by_position.values())
    bucket = place.bucket_bytes
    send, handoff = Phase("shard-to-engine"), Phase("hand-off to engine workers")
    need: dict[int, int] = {}
    position_of: dict[int, tuple[int, int]] = {}
    for replica in range(place.engine_replicas):
        receiver = place.engine_gpu(replica, 0, 0)
        for owner, (nbytes, largest) in flows.items():
            msgs = _messages(nbytes, largest, bucket)
            if fanout == "direct" or replica == 0:
                send.move(owner, receiver, nbytes, place.link(owner, receiver), messages=msgs)
                send.gpus[owner].extra = max(send.gpus[owner].extra, min(nbytes, max(bucket, largest)))
                send.gpus[owner].packed += nbytes
            else:  # the previous replica's receiver passes each owner's messages on
                previous = place.engine_gpu(replica - 1, 0, 0)
                send.move(previous, receiver, nbytes, place.link(previous, receiver), messages=msgs)
        send.gpus[receiver].extra = min(total, 2 * bucket)
        for (stage, rank), nbytes in need_by_position.items():
            gpu = place.engine_gpu(replica, stage, rank)
            need[gpu], position_of[gpu] = nbytes, (stage, rank)
            handoff.gpus[receiver].packed += nbytes
            handoff.gpus[gpu].extra = max(handoff.gpus[gpu].extra, -(-min(total, bucket) * nbytes // total))
            if gpu != receiver:
                msgs = max(1, -(-total // bucket))
                handoff.move(receiver, gpu, nbytes, place.link(receiver, gpu), messages=msgs)
    if fanout == "relay" and place.engine_replicas > 1:
        send.pipeline_fill_bytes = (place.engine_replicas - 1) * min(bucket, total)
        send.pipeline_fill_link = place.link(place.engine_gpu(0, 0, 0), place.engine_gpu(1, 0, 0))
    return SyncPlan(f"shard-to-engine ({fanout})", [send, handoff], need, position_of)


def bucket_sizes(sizes: Iterable[int], bucket_bytes: int) -> list[int]:
    """Greedy buckets of at most ``bucket_bytes`` in stream order (a larger tensor fills one alone);
    ``buckets.iter_buckets`` also never splits a fused group, which this ignores."""
    out: list[int] = []
    current = 0
    for size in sizes:
        if current and current + size > bucket_bytes:
            out.append(current)
            current = 0
        current += size
    if current:
        out.append(current)
    return out


def rank0(
    tensors: list[TensorLayout],
    place: Placement,
    *,
    plan: dict[tuple[int, int], list[SliceCopy]] | None = None,
) -> SyncPlan:
    """Today's broadcast transport, phase by phase (module docstring). Extra memory: rank 0 holds
    one bucket's gathered tensors and their packed copy (2 × the largest bucket); a receiver its
    flat buffer (the largest bucket); a worker its regions of one bucket (its share of it)."""
    place.check()
    layouts = {t.hf_name: t for t in tensors}
    whole = plan_weight_sync(tensors, place.trainer, EngineLayout(tp=1))[0]
    gather = Phase("gather to rank 0")
    total = 0
    for c in whole:
        nbytes = copy_bytes(c, place.dtype_bytes)
        total += nbytes
        owner = place.owner(c, is_expert(layouts[c.hf_name]))
        if owner != 0:
            gather.move(owner, 0, nbytes, place.link(owner, 0), messages=1)
    buckets = bucket_sizes((math.prod(t.shape) * place.dtype_bytes for t in tensors), place.bucket_bytes)
    largest = max(buckets)
    pack = Phase("pack at rank 0")
    pack.gpus[0].packed = total
    pack.gpus[0].extra = 2 * largest
    broadcast = Phase("broadcast")
    receivers = [place.engine_gpu(k, 0, 0) for k in range(place.engine_replicas)]
    chain = [0, *receivers]
    calls = 3 * len(buckets) + 1
    for src, dst in itertools.pairwise(chain):
        broadcast.move(src, dst, total, place.link(src, dst), messages=0)
    broadcast.calls = calls
    for gpu in chain:
        broadcast.gpus[gpu].messages += calls
    for gpu in receivers:
        broadcast.gpus[gpu].extra = largest
    need: dict[int, int] = {}
    position: dict[int, tuple[int, int]] = {}
    handoff = Phase("hand-off to engine workers")
    plan = plan if plan is not None else replica_plan(tensors, place)
    for replica, receiver in enumerate(receivers):
        for (stage, rank), copies in plan.items():
            gpu = place.engine_gpu(replica, stage, rank)
            nbytes = sum(copy_bytes(c, place.dtype_bytes) for c in copies)
            need[gpu] = nbytes
            position[gpu] = (stage, rank)
            handoff.gpus[receiver].packed += nbytes  # the receiver unpacks each worker's regions
            handoff.gpus[gpu].extra = max(handoff.gpus[gpu].extra, -(-largest * nbytes // total))
            if gpu != receiver:
                handoff.move(receiver, gpu, nbytes, place.link(receiver, gpu), messages=len(buckets))
    return SyncPlan("rank-0 broadcast", [gather, pack, broadcast, handoff], need, position)
