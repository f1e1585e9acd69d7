"""Which tensors and columns a sync's verification checks (``rltrain.weight_sync.sampling``), and the
sender stopping the run on a planted mismatch, against hand-derived expectations."""

from __future__ import annotations

import pytest
import torch

from megatron_bridge.reshard import EngineLayout
from rltrain.errors import WeightSyncMismatchError
from rltrain.logging import metrics as mk
from rltrain.weight_sync.checksum import tensor_digest
from rltrain.weight_sync.sampling import (
    COLUMNS_PER_TENSOR,
    DigestRequest,
    digest_request,
    sample_columns,
    take_columns,
    verify_mode,
)
from rltrain.weight_sync.sender import WeightSender
from rltrain.weight_sync.transport import ColocatedTransport
from rltrain.weight_sync.types import SyncStats, TensorRegions, TensorSource

NAMES = [f"t{i}.weight" for i in range(7)]  # each of its own module


def test_true_and_false_mean_full_and_off():
    assert [verify_mode(v) for v in (True, False, "sampled", "full", "off")] == [
        "full",
        "off",
        "sampled",
        "full",
        "off",
    ]
    with pytest.raises(ValueError, match=r"verify_checksums='all' is not one of sampled, full, off"):
        verify_mode("all")


def test_the_first_sync_checks_everything_whole_then_a_rotating_subset():
    first = digest_request(NAMES, sync_index=0, every=3, mode="sampled")
    assert first.tensors == dict.fromkeys(NAMES, False) and first.skip_unsupported
    # modules at positions i with i % 3 == k % 3, on sampled columns
    assert digest_request(NAMES, sync_index=1, every=3, mode="sampled").tensors == {
        "t1.weight": True,
        "t4.weight": True,
    }
    assert digest_request(NAMES, sync_index=2, every=3, mode="sampled").tensors == {
        "t2.weight": True,
        "t5.weight": True,
    }
    assert digest_request(NAMES, sync_index=3, every=3, mode="sampled").tensors == {
        "t0.weight": True,
        "t3.weight": True,
        "t6.weight": True,
    }
    full = digest_request(NAMES, sync_index=5, every=3, mode="full")
    assert full.tensors == dict.fromkeys(NAMES, False) and not full.skip_unsupported


LAYER = [  # export order of a llama layer: q, k, v load into qkv_proj, gate and up into gate_up_proj
    f"model.layers.0.{m}.weight"
    for m in (
        "input_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "post_attention_layernorm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
]


def test_the_rotation_checks_a_fused_module_at_one_sync():
    """By hand: modules 0 norm, 1 qkv, 2 o, 3 norm, 4 gate_up, 5 down; every=3."""
    rotation = [set(digest_request(LAYER, sync_index=k, every=3, mode="sampled").tensors) for k in (1, 2, 3)]
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    assert rotation[0] == {f"{attn}{x}_proj.weight" for x in "qkv"} | {
        f"{mlp}{x}_proj.weight" for x in ("gate", "up")
    }
    assert rotation[1] == {f"{attn}o_proj.weight", f"{mlp}down_proj.weight"}
    assert rotation[2] == {f"model.layers.0.{x}_layernorm.weight" for x in ("input", "post_attention")}


@pytest.mark.parametrize("start", [1, 5, 12])
@pytest.mark.parametrize("names", [NAMES, LAYER], ids=["tensors", "layer"])
def test_every_tensor_is_checked_within_every_syncs(start, names):
    seen: set[str] = set()
    for k in range(start, start + 8):
        seen |= set(digest_request(names, sync_index=k, every=8, mode="sampled").tensors)
    assert seen == set(names)


def test_sampled_columns_are_the_same_for_a_fused_module_and_change_with_the_sync():
    q = sample_columns("model.layers.0.self_attn.q_proj.weight", 3, 576)
    k = sample_columns("model.layers.0.self_attn.k_proj.weight", 3, 576)
    o = sample_columns("model.layers.0.self_attn.o_proj.weight", 3, 576)
    assert q == k and len(q) == COLUMNS_PER_TENSOR and q == sorted(set(q)) and q[0] >= 0 and q[-1] < 576
    assert o != q and sample_columns("model.layers.0.self_attn.q_proj.weight", 4, 576) != q
    assert sample_columns("model.norm.weight", 3, 5) == [0, 1, 2, 3, 4]  # narrow: whole
    request = DigestRequest(3, {"a": True, "b": False})
    assert request.columns("a", 576) == sample_columns("a", 3, 576)
    assert request.columns("b", 576) is None and request.columns("c", 576) is None
    t = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(take_columns(t, [1, 3]), torch.tensor([[1.0, 3.0], [5.0, 7.0], [9.0, 11.0]]))
    scalar = torch.tensor(2.5)  # a 0-d parameter: one column, itself
    assert request.columns_of("a", scalar) == [0] and take_columns(scalar, [0]) is scalar


class _Engine:
    """Keeps what it receives; digests what a request names, as an engine's readback does."""

    num_workers = 1

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.requests: list[DigestRequest | None] = []

    def receive(self, updates, *, bucket_bytes: int) -> SyncStats:
        n = 0
        for update in updates:
            self.weights[update.name] = update.full(0).clone()
            n += 1
        return SyncStats(n, 0, 1, 0.0)

    def all_weights_digests(self, request=None) -> list[dict[str, str]]:
        self.requests.append(request)
        names = self.weights if request is None else request.tensors
        return [
            {
                n: tensor_digest(
                    take_columns(
                        self.weights[n],
                        None if request is None else request.columns(n, self.weights[n].shape[-1]),
                    )
                )
                for n in names
            }
        ]


def _sender(weights: dict[str, torch.Tensor], engine: _Engine, every: int) -> WeightSender:
    transport = ColocatedTransport(
        rank=0, host_ranks=[0], engine=engine, layout=EngineLayout(tp=1), bucket_bytes=1 << 20
    )
    return WeightSender(
        TensorSource(weights),
        transport,
        rank=0,
        host_ranks=[0],
        engine=engine,
        engine_tp=1,
        verify="sampled",
        verify_every=every,
    )


def test_a_wrong_slice_planted_in_the_engine_stops_the_sync_that_samples_it():
    weights = {f"w{i}.weight": torch.arange(40.0).reshape(2, 20) + i for i in range(4)}
    engine = _Engine()
    sender = _sender(weights, engine, every=2)
    metrics = sender.sync()  # sync 0: everything whole
    assert (
        metrics[mk.WEIGHT_SYNC_CHECKSUM_MISMATCHES] == 0.0 and metrics[mk.WEIGHT_SYNC_VERIFIED_TENSORS] == 4
    )
    assert engine.requests[-1].tensors == dict.fromkeys(weights, False)
    # sync 1 checks w1 and w3 on 8 of their 20 columns; w1 is planted wrong at a sampled column,
    # w0 (not checked at sync 1) at any column
    column = sample_columns("w1.weight", 1, 20)[0]
    real_receive = engine.receive

    def corrupting_receive(updates, *, bucket_bytes):
        stats = real_receive(updates, bucket_bytes=bucket_bytes)
        engine.weights["w0.weight"][0, 0] += 1.0
        engine.weights["w1.weight"][1, column] += 1.0
        return stats

    engine.receive = corrupting_receive
    with pytest.raises(WeightSyncMismatchError) as stopped:
        sender.sync()
    assert engine.requests[-1].tensors == {"w1.weight": True, "w3.weight": True}
    assert str(stopped.value) == (
        "weight sync verification failed: w1.weight on engine rank 0 (the engine of trainer rank 0) differs from "
        "what trainer rank 0 sent (sha256 of its sampled columns, sync 1)"
    )


def test_a_restarted_sender_checks_at_each_step_what_the_uninterrupted_one_did():
    """Syncs are numbered by the step whose weights they carry: a new sender (a restart's new engine)
    checks its first sync whole whatever its step, then at each step the tensors the sender that ran
    from step 0 checked there (the run's metrics after a resume equal the uninterrupted run's)."""
    weights = {f"w{i}.weight": torch.full((2, 20), float(i)) for i in range(5)}
    whole, resumed = _Engine(), _Engine()
    uninterrupted = _sender(weights, whole, every=3)
    for step in range(5):
        uninterrupted.sync(step)
    restarted = _sender(weights, resumed, every=3)
    metrics = [restarted.sync(step) for step in (2, 3, 4)]  # resumed from step 2's checkpoint
    assert resumed.requests[0].tensors == dict.fromkeys(weights, False)
    assert [r.tensors for r in resumed.requests[1:]] == [r.tensors for r in whole.requests[3:]]
    assert whole.requests[3].tensors == {"w0.weight": True, "w3.weight": True}  # modules 0 and 3: 3 % 3
    assert [m[mk.WEIGHT_SYNC_VERIFIED_TENSORS] for m in metrics] == [5, 2, 2]


def test_a_slice_outside_the_sampled_columns_is_caught_when_its_tensor_is_checked_whole():
    weights = {"w0": torch.zeros(2, 20), "w1": torch.ones(2, 20)}
    engine = _Engine()
    sender = _sender(weights, engine, every=2)
    sender.sync()
    engine.weights["w0"][0, 0] = 5.0  # after the sync: the next one loads over it
    assert sender.verify() == [
        "weight sync verification failed: w0 on engine rank 0 (the engine of trainer rank 0) differs from "
        "what trainer rank 0 sent (sha256 of its whole shard, sync 1)"
    ]


def test_the_trainer_digests_the_regions_of_each_worker_it_streamed():
    t = torch.arange(24.0).reshape(4, 6)
    update = TensorRegions(
        "w", (4, 6), {0: [((slice(0, 2), slice(0, 6)), t[:2])], 1: [((slice(2, 4), slice(0, 6)), t[2:])]}
    )
    update.senders = {0: [0], 1: [1]}
    engine = _Engine()
    sender = _sender({}, engine, every=8)
    digester = sender.check.digester(None)
    assert list(digester.tap([update])) == [update]
    assert digester.expected == {0: {"w": tensor_digest(t[:2])}, 1: {"w": tensor_digest(t[2:])}}
    assert digester.senders == {("w", 0): [0], ("w", 1): [1]}
