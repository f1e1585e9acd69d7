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
    assert isinstance(make_transport("auto", mode="separate", **separate), BroadcastTransport)
    with pytest.raises(ValueError, match=r"rollout\.mode=separate needs broadcast"):
        make_transport("in_process", mode="separate", **separate)
    with pytest.raises(ValueError, match=r"not rollout\.mode=colocated"):
        make_transport("broadcast", mode="colocated", **common)
    with pytest.raises(ValueError, match="'nccl_p2p' is not one of auto, in_process, broadcast"):
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

    transport = make_transport("auto", mode="separate", rank=3, host_ranks=[], engine_tp=2, bucket_bytes=1)
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
