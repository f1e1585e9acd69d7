"""Transport selection, the colocated and broadcast send/receive paths, and the digest helpers (no
vLLM: a recording engine stands in for ``VllmEngine.receive``, which the e2e/dist tiers run)."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from megatron_bridge.reshard import EngineLayout
from rltrain.weight_sync import ColocatedTransport, SyncStats, TensorRegions, TensorSource, make_transport
from rltrain.weight_sync.broadcast import BroadcastTransport, standalone_group
from rltrain.weight_sync.checksum import compare_digests, digests, tensor_digest
from rltrain.weight_sync.shard_to_shard import ShardToShardSender


class RecordingEngine:
    num_workers = 1

    def __init__(self) -> None:
        self.received: list[tuple[str, torch.Tensor]] = []
        self.calls = 0

    def receive(self, updates, *, bucket_bytes: int) -> SyncStats:
        got = [(u.name, u.full(0).clone()) for u in updates]  # a copy: the sender's buffers move on
        self.received += got
        self.calls += 1
        return SyncStats(len(got), sum(t.numel() * t.element_size() for _, t in got), 1, 0.0, "direct")


def test_make_transport_selects_by_config_and_refuses_impossible_ones():
    engine = RecordingEngine()
    common = dict(rank=0, host_ranks=[0], engine_tp=1, bucket_bytes=1, engine=engine)
    assert isinstance(make_transport("auto", mode="colocated", **common), ColocatedTransport)
    assert isinstance(make_transport("in_process", mode="colocated", **common), ColocatedTransport)
    separate = dict(rank=1, host_ranks=[], engine_tp=1, bucket_bytes=1)
    assert isinstance(make_transport("auto", mode="separate", **separate), ShardToShardSender)
    assert isinstance(make_transport("broadcast", mode="separate", **separate), BroadcastTransport)
    with pytest.raises(ValueError, match=r"rollout\.mode=separate needs shard_to_shard or broadcast"):
        make_transport("in_process", mode="separate", **separate)
    for kind in ("broadcast", "shard_to_shard"):
        with pytest.raises(ValueError, match=rf"transport={kind} .*not rollout\.mode=colocated"):
            make_transport(kind, mode="colocated", **common)
    with pytest.raises(
        ValueError, match="'nccl_p2p' is not one of auto, in_process, shard_to_shard, broadcast"
    ):
        make_transport("nccl_p2p", mode="colocated", **common)
    with pytest.raises(
        ValueError, match=r"trainer rank 1: an engine is needed exactly on the host ranks \[0\]"
    ):
        make_transport("auto", mode="colocated", **{**common, "rank": 1})


def test_colocated_transport_hands_the_tensors_over_unchanged():
    engine = RecordingEngine()
    weights = [("model.norm.weight", torch.randn(8)), ("lm_head.weight", torch.randn(4, 8))]
    transport = make_transport(
        "auto", mode="colocated", rank=0, host_ranks=[0], engine_tp=1, bucket_bytes=1 << 20, engine=engine
    )
    stats = transport.send(TensorSource(weights))
    assert stats.num_tensors == 2 and stats.num_bytes == (8 + 32) * 4 and engine.calls == 1
    assert all(n == m and torch.equal(t, u) for (n, t), (m, u) in zip(weights, engine.received))


def test_tensor_regions_full_and_shard_assemble_a_worker_part():
    full = torch.arange(24.0).reshape(6, 4)
    rows = (slice(2, 4), slice(0, 4)), (slice(4, 6), slice(0, 4))
    update = TensorRegions("w", (6, 4), {1: [(s, full[s].clone()) for s in rows]})
    assert torch.equal(update.full(1)[2:6], full[2:6])
    assert torch.equal(update.shard(1), full[2:6])  # the bounding box of its regions
    whole = TensorRegions.whole("w", full, num_workers=2)
    assert whole.full(0) is full and whole.full(1) is full  # no copy, every worker the same tensor
    assert whole.num_bytes == full.numel() * 4  # a tensor two workers share counts once


def test_broadcast_between_two_threads_is_bit_exact_and_reuses_its_buffers():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    weights = [(f"model.layers.{i}.mlp.down_proj.weight", torch.randn(16, 32)) for i in range(5)]
    weights.append(("model.norm.weight", torch.randn(7).to(torch.bfloat16)))
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        group = standalone_group(host="127.0.0.1", port=port, rank=r, world_size=2, timeout_s=60)
        transport = BroadcastTransport(group=group, src_rank=0, bucket_bytes=4096)  # two tensors a bucket
        if r == 0:
            results[0] = [transport.send(TensorSource(weights)) for _ in range(2)]
        else:
            engine = RecordingEngine()
            stats = [transport.receive(engine) for _ in range(2)]
            results[1] = (stats, engine, transport._pool._buffers)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    sent, (got, engine, buffers) = results[0], results[1]
    for a, b in zip(sent, got):
        assert a.num_buckets == b.num_buckets == 3 and a.num_bytes == b.num_bytes and b.path == "direct"
    assert engine.calls == 6  # one engine call per bucket: each bucket is taken in before the next
    assert len(buffers) == 1 and buffers[0].numel() == 4096  # one receive buffer for both syncs
    assert [n for n, _ in engine.received] == [n for n, _ in weights] * 2
    assert all(
        t.dtype == u.dtype and torch.equal(t, u) for (_, t), (_, u) in zip(weights * 2, engine.received)
    )


def test_trainer_ranks_outside_the_broadcast_group_only_serve_their_slices():
    served = []

    class Source:
        def regions(self, engine: EngineLayout, *, dst: int):
            served.append((engine, dst))
            yield TensorRegions.whole("w", torch.ones(2))

    transport = make_transport(
        "broadcast", mode="separate", rank=3, host_ranks=[], engine_tp=2, bucket_bytes=1
    )
    assert transport.send(Source()) is None and served == [(EngineLayout(tp=1), 0)]


def test_digests_are_bitwise_and_cast_to_the_engine_dtype():
    t = torch.randn(4, 4)
    assert tensor_digest(t) == tensor_digest(t.clone())
    nudged = t.clone()
    nudged[0, 0] = torch.nextafter(nudged[0, 0], torch.tensor(1e9))
    assert tensor_digest(nudged) != tensor_digest(t)
    assert tensor_digest(t, torch.bfloat16) == tensor_digest(t.to(torch.bfloat16))
    expected = digests([("a", t), ("b", t * 2)])
    problems = compare_digests(expected, {"a": tensor_digest(t), "b": tensor_digest(t)})
    assert problems == ["b: engine weights differ from the trainer's (sha256 mismatch)"]
    assert compare_digests(expected, {"a": expected["a"]}) == [
        "b: sent by the trainer but not found among the engine's weights"
    ]


class TwoOwnerSource:
    """Stands in for ``PlannedExport`` on two trainer ranks: ``w`` (8×4) is split by rows between an
    engine's two workers, rank 0 owning rows 0-3 and rank 1 rows 4-7; ``b`` (4) is read whole by
    both workers, from rank 0; ``n`` (bf16, 6) likewise from rank 1."""

    def __init__(self, rank: int, step: int) -> None:
        gen = torch.Generator().manual_seed(step)
        self.rank = rank
        self.full = {
            f"model.layers.{i}.mlp.down_proj.weight": torch.randn(8, 4, generator=gen) for i in range(3)
        }
        self.full["model.norm.weight"] = torch.randn(4, generator=gen)
        self.full["lm_head.bias"] = torch.randn(6, generator=gen).to(torch.bfloat16)

    def schedule(self, engine, *, bucket_bytes: int):
        from rltrain.weight_sync.shard_to_shard import Schedule, Slot

        copies = []
        for name, t in self.full.items():
            whole = tuple(slice(0, s) for s in t.shape)
            if t.dim() == 2:
                top, bottom = (slice(0, 4), slice(0, 4)), (slice(4, 8), slice(0, 4))
                copies += [(Slot(name, 0, 0, top, top), t.shape, t.dtype)]
                copies += [(Slot(name, 1, 1, bottom, bottom), t.shape, t.dtype)]
            else:
                owner = 1 if t.dtype == torch.bfloat16 else 0
                copies += [(Slot(name, w, owner, whole, whole), t.shape, t.dtype) for w in (0, 1)]
        return Schedule.build(copies, bucket_bytes=bucket_bytes, num_trainer_ranks=2)

    def serve(self, schedule):
        for bucket in schedule.buckets:
            yield bucket, (self.full[s.name][s.src] for s in bucket.slots.get(self.rank, []))


class RegionEngine:
    """Records each worker's regions (copies) of every bucket it is handed."""

    num_workers = 2

    def __init__(self) -> None:
        self.got: list[dict[tuple[str, int], torch.Tensor]] = []

    def receive(self, updates, *, bucket_bytes: int) -> SyncStats:
        bucket = {(u.name, w): u.shard(w).clone() for u in updates for w in u.regions}
        self.got.append(bucket)
        return SyncStats(len(bucket), 0, 1, 0.0, "reload")


@pytest.mark.parametrize("fanout", ["direct", "relay"])
def test_shard_to_shard_sends_each_owner_slice_to_every_engine_bit_exact(fanout):
    """Two trainer ranks and two engines (threads, one real gloo group of four): every engine
    worker gets exactly its rows from their owner, each owner sends only its own slices (to each
    engine, or with relay to engine 0, which passes them on to engine 1), and the buffers stay
    within the schedule's bound (all derived by hand below)."""
    from rltrain.weight_sync.shard_to_shard import ShardToShardReceiver, ShardToShardSender

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results: dict[int, object] = {}
    bucket_bytes = (
        2 * 8 * 4 * 4
    )  # two 8×4 fp32 tensors (256 bytes): buckets of layers {0, 1}, {2, norm, bias}

    def member(r: int) -> None:
        group = standalone_group(host="127.0.0.1", port=port, rank=r, world_size=4, timeout_s=60)
        if r < 2:
            sender = ShardToShardSender(
                group=group,
                rank=r,
                num_engines=2,
                engine=EngineLayout(tp=2),
                bucket_bytes=bucket_bytes,
                fanout=fanout,
            )
            stats = [sender.send(TwoOwnerSource(r, step)) for step in (1, 2)]
            results[r] = (stats, sender.last_sent_bytes, sender.peak_extra_bytes)
        else:
            receiver = ShardToShardReceiver(group=group, bucket_bytes=bucket_bytes)
            engine = RegionEngine()
            stats = [receiver.receive(engine) for _ in (1, 2)]
            results[r] = (stats, engine, receiver.peak_extra_bytes, receiver.schedule)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == [0, 1, 2, 3]
    # per engine: rank 0 sends 3 × 64 bytes of rows + the norm twice (16 + 16); rank 1 3 × 64 + bias twice (12 + 12)
    (stats0, sent0, extra0), (stats1, sent1, extra1) = results[0], results[1]
    copies = 2 if fanout == "direct" else 1  # relay: engine 0's copy only
    assert sent0 == copies * (3 * 64 + 32) and sent1 == copies * (3 * 64 + 24)
    assert stats1 == [None, None]  # the sync's stats come from rank 0
    assert [s.num_bytes for s in stats0] == [copies * (3 * 64 * 2 + 32 + 24)] * 2  # the trainer's, together
    assert [s.num_buckets for s in stats0] == [2, 2] and stats0[0].num_tensors == 5
    # a trainer rank packs one message at a time: its largest is its half of two layers (128 bytes)
    assert extra0 == extra1 == 128
    for r in (2, 3):
        _, engine, extra, schedule = results[r]
        assert schedule.extra_bytes("trainer", 0) == schedule.extra_bytes("trainer", 1) == 128
        assert extra == schedule.extra_bytes("engine") == 256 + 184  # both buckets (2 × 128; 128 + 32 + 24)
        assert len(engine.got) == 4  # two buckets per sync, one engine call each
        for sync, step in ((0, 1), (1, 2)):
            full = TwoOwnerSource(0, step).full
            got = {**engine.got[2 * sync], **engine.got[2 * sync + 1]}
            assert len(got) == 10
            for (name, worker), values in got.items():
                want = full[name] if full[name].dim() == 1 else full[name][4 * worker : 4 * worker + 4]
                assert values.dtype == want.dtype and torch.equal(values, want), (name, worker)


def test_a_shard_to_shard_wait_that_times_out_names_what_it_waited_for():
    """An engine whose trainer never sends (a frozen rank 0): the group's timeout ends its wait in
    one line naming the wait, not gloo's bare message."""
    from rltrain.weight_sync.shard_to_shard import ShardToShardReceiver

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    errors: dict[int, BaseException] = {}
    ready = threading.Event()

    def member(r: int) -> None:
        group = standalone_group(host="127.0.0.1", port=port, rank=r, world_size=2, timeout_s=1)
        if r == 0:  # the trainer: joins, then sends nothing
            ready.wait(30)
            return
        try:
            ShardToShardReceiver(group=group, bucket_bytes=1024).receive(RegionEngine())
        except RuntimeError as e:
            errors[r] = e
        finally:
            ready.set()

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    message = str(errors[1])
    assert message.startswith(
        "weight sync (shard_to_shard): group rank 1 (an engine) waiting for the schedule from trainer rank 0 failed: "
    )
    assert "\n" not in message
