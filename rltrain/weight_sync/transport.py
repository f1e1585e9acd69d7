"""How weights reach the engines, behind one small interface chosen in one place (``make_transport``).

- ``ColocatedTransport`` (``weight_sync.transport: in_process``; ``auto`` with ``rollout.mode:
  colocated``): the engine shares this trainer's processes and devices. For every engine, its host
  trainer rank receives the engine's planned regions (each slice once, from the rank that owns it)
  and hands them to ``engine.receive``, which gives each of its workers its own regions: the
  tensors themselves to an in-process worker, one buffer per worker to workers in other processes
  (CUDA IPC handles on GPU, serialized on CPU). No copy of the stream is made here.
- ``ShardToShardSender`` (``shard_to_shard``; ``auto`` with ``rollout.mode: separate``, in
  ``rltrain.weight_sync.shard_to_shard``): every trainer rank sends the planned slices it owns
  straight to every engine on other devices, bucket by bucket, over one process group of all
  trainer ranks and engines; each engine hands every bucket to the same ``engine.receive``.
- ``BroadcastTransport`` (``broadcast``, in ``rltrain.weight_sync.broadcast``): the plan where
  trainer rank 0 receives the whole tensors and broadcasts them in buckets over a process group of
  itself and the engines (for comparison, and where only rank 0 may reach the engines).
One send path and one receive path per transport. ``send`` is collective over the trainer's ranks
and returns the stats on the rank that reports them (None elsewhere).
"""

from __future__ import annotations

from typing import Any, Protocol

from megatron_bridge.reshard import EngineLayout
from rltrain.weight_sync.types import EngineReceiver, SyncStats, WeightSource, drain

TRANSPORTS = ("auto", "in_process", "shard_to_shard", "broadcast")


class WeightTransport(Protocol):
    """The trainer-side verb: move ``source``'s weights to the engines this transport reaches."""

    def send(self, source: WeightSource) -> SyncStats | None: ...


class ColocatedTransport:
    """Engines in the trainer's own processes: one on each of ``host_ranks``; ``engine`` is this
    rank's (None on the other ranks, which only serve their slices)."""

    def __init__(
        self,
        *,
        rank: int,
        host_ranks: list[int],
        engine: EngineReceiver | None,
        layout: EngineLayout,
        bucket_bytes: int,
    ) -> None:
        if (rank in host_ranks) != (engine is not None):
            raise ValueError(
                f"trainer rank {rank}: an engine is needed exactly on the host ranks {host_ranks}"
            )
        self.rank, self.host_ranks, self.engine = rank, list(host_ranks), engine
        self.layout, self.bucket_bytes = layout, bucket_bytes

    def send(self, source: WeightSource) -> SyncStats | None:
        stats = None
        for host in self.host_ranks:
            updates = source.regions(self.layout, dst=host)
            if host == self.rank:
                assert self.engine is not None
                stats = self.engine.receive(updates, bucket_bytes=self.bucket_bytes)
            else:
                drain(updates)
        return stats


def make_transport(
    kind: str,
    *,
    mode: str,
    rank: int,
    host_ranks: list[int],
    engine_tp: int,
    bucket_bytes: int,
    engine: Any = None,
    group: Any = None,
    device: Any = "cpu",
    num_engines: int = 1,
    fanout: str = "relay",
) -> WeightTransport:
    """The trainer-side transport ``rollout.weight_sync.transport`` names for ``rollout.mode``.

    ``auto`` is ``in_process`` for colocated engines and ``shard_to_shard`` for separate ones; the
    other pairings are refused (the config refuses them too). ``group`` (separate mode): the
    weights' group of ``weight_sync.broadcast.join_broadcast_group`` (every trainer rank for
    ``shard_to_shard``, rank 0 alone for ``broadcast``; None on the others); ``num_engines``: the
    separate engines; ``fanout``: ``rollout.weight_sync.fanout``.
    """
    if kind not in TRANSPORTS:
        raise ValueError(f"rollout.weight_sync.transport={kind!r} is not one of {', '.join(TRANSPORTS)}")
    if kind == "auto":
        kind = "in_process" if mode == "colocated" else "shard_to_shard"
    if kind == "in_process":
        if mode != "colocated":
            raise ValueError(
                "rollout.weight_sync.transport=in_process reaches engines in the trainer's processes "
                f"only; rollout.mode={mode} needs shard_to_shard or broadcast"
            )
        return ColocatedTransport(
            rank=rank,
            host_ranks=host_ranks,
            engine=engine,
            layout=EngineLayout(tp=engine_tp),
            bucket_bytes=bucket_bytes,
        )
    if mode != "separate":
        raise ValueError(
            f"rollout.weight_sync.transport={kind} is for engines on other devices "
            f"(rollout.mode=separate), not rollout.mode={mode}"
        )
    if kind == "shard_to_shard":
        from rltrain.weight_sync.shard_to_shard import ShardToShardSender

        return ShardToShardSender(
            group=group,
            rank=rank,
            num_engines=num_engines,
            engine=EngineLayout(tp=engine_tp),
            bucket_bytes=bucket_bytes,
            device=device,
            fanout=fanout,
        )
    from rltrain.weight_sync.broadcast import BroadcastTransport

    return BroadcastTransport(group=group, src_rank=0, bucket_bytes=bucket_bytes, device=device, rank=rank)
