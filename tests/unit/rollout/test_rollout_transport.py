"""Transport selection and the digest helpers (no vLLM: a recording engine stands in for routing)."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from rltrain.rollout.checksum import compare_digests, digests, tensor_digest
from rltrain.rollout.engine import LoadStats
from rltrain.rollout.transport import BroadcastTransport, InProcessTransport, make_transport, standalone_group


class RecordingEngine:
    in_process, on_gpu = True, False

    def __init__(self) -> None:
        self.received: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, named, *, bucket_bytes: int) -> LoadStats:
        self.received = [(n, t.clone()) for n, t in named]
        return LoadStats(len(self.received), sum(t.numel() * t.element_size() for _, t in self.received), 0.0)


def test_make_transport_selects_by_config_and_refuses_impossible_ones():
    engine = RecordingEngine()
    assert isinstance(make_transport("auto", bucket_bytes=1, engine=engine), InProcessTransport)
    with pytest.raises(ValueError, match="needs a process group"):
        make_transport("auto", bucket_bytes=1)
    with pytest.raises(ValueError, match=r"cuda_ipc.*on_gpu=False, in_process=True"):
        make_transport("cuda_ipc", bucket_bytes=1, engine=engine)
    with pytest.raises(ValueError, match="'nccl_p2p' is not one of"):
        make_transport("nccl_p2p", bucket_bytes=1, engine=engine)


def test_in_process_transport_hands_the_stream_over_unchanged():
    engine = RecordingEngine()
    weights = [("model.norm.weight", torch.randn(8)), ("lm_head.weight", torch.randn(4, 8))]
    stats = InProcessTransport(engine, bucket_bytes=1 << 20).send(weights)
    assert stats.num_tensors == 2 and stats.num_bytes == (8 + 32) * 4
    assert all(n == m and torch.equal(t, u) for (n, t), (m, u) in zip(weights, engine.received))


def test_broadcast_between_two_threads_is_bit_exact():
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
            results[0] = transport.send(weights)
        else:
            engine = RecordingEngine()
            results[1] = (transport.receive(engine), engine.received)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    sent, (got, received) = results[0], results[1]
    assert sent.num_buckets == got.num_buckets == 3 and sent.num_bytes == got.num_bytes
    assert [n for n, _ in received] == [n for n, _ in weights]
    assert all(t.dtype == u.dtype and torch.equal(t, u) for (_, t), (_, u) in zip(weights, received))


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
