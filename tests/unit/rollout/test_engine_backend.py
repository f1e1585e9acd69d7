"""Another engine backend is one more registry entry: a test-only backend (``ScriptedEngineDouble``)
registered under a new ``rollout.name`` is built by the rollout worker from the config and driven
through the engine protocol only (``rltrain.rollout.protocol``): generation, sleep/wake around it,
weight receive through the trainer's transport, and checksums through the sender's verification."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megatron_bridge.reshard import EngineLayout
from rltrain.config import load_config
from rltrain.logging import metrics as mk
from rltrain.rollout.protocol import EngineSettings, Prompt, RolloutEngine
from rltrain.rollout.registry import EngineBackend, backend_names, register_backend, unregister_backend
from rltrain.rollout.types import RolloutOutput, Sample, SamplingConfig
from rltrain.weight_sync.checksum import tensor_digest
from rltrain.weight_sync.sampling import DigestRequest, take_columns
from rltrain.weight_sync.sender import WeightSender
from rltrain.weight_sync.transport import ColocatedTransport
from rltrain.weight_sync.types import NamedTensor, SyncStats, TensorRegions, TensorSource
from rltrain.workers.rank_base import RankInfo
from rltrain.workers.rollout_worker import RolloutWorker

QUICKSTART = Path(__file__).resolve().parents[3] / "recipes" / "quickstart_cpu.yaml"


@dataclass(frozen=True)
class ScriptOptions:
    """The double's own options (``EngineSettings.options``), read from the config by its backend."""

    token_offset: int


class ScriptedEngineDouble:
    """A rollout engine that answers from a script: token ``j`` of sample ``k`` of a prompt is
    ``prompt[-1] + sum of every received weight + token_offset + 10 k + j``, its logprob
    ``-(j + 1) / 4``; so what it generates shows which weights it received."""

    def __init__(self, model_dir: str, settings: EngineSettings, *, asynchronous: bool) -> None:
        self.model_dir, self.settings, self.asynchronous = model_dir, settings, asynchronous
        self.tokenizer = None
        self.weights: dict[str, torch.Tensor] = {}
        self.calls: list[str] = []
        self.asleep = False

    @property
    def num_workers(self) -> int:
        return self.settings.tensor_model_parallel_size

    def generate(self, prompts: list[Prompt], sampling: SamplingConfig) -> RolloutOutput:
        assert not self.asleep, "generate() on a sleeping engine"
        self.calls.append("generate")
        base = int(sum(float(t.sum()) for t in self.weights.values())) + self.settings.options.token_offset
        samples = [
            [
                Sample(
                    [p[-1] + base + 10 * k + j for j in range(sampling.response_length)],
                    [-(j + 1) / 4 for j in range(sampling.response_length)],
                    "length",
                    None,
                )
                for k in range(sampling.n)
            ]
            for p in prompts
        ]
        return RolloutOutput.from_samples([list(p) for p in prompts], samples, n=sampling.n)

    def receive(self, updates: Iterable[TensorRegions], *, bucket_bytes: int = 1 << 20) -> SyncStats:
        self.calls.append("receive")
        num_tensors = num_bytes = 0
        for update in updates:
            self.weights[update.name] = update.full(0).clone()
            num_tensors, num_bytes = num_tensors + 1, num_bytes + update.num_bytes
        return SyncStats(num_tensors, num_bytes, 1, 0.25, "scripted")

    def load_weights(self, named_tensors: Iterable[NamedTensor], *, bucket_bytes: int = 1 << 20) -> SyncStats:
        return self.receive((TensorRegions.whole(n, t, self.num_workers) for n, t in named_tensors))

    def weights_digests(self) -> dict[str, str]:
        return self.all_weights_digests()[0]

    def all_weights_digests(self, request: DigestRequest | None = None) -> list[dict[str, str]]:
        if request is None:
            return [{name: tensor_digest(t) for name, t in self.weights.items()}]
        return [
            {
                name: tensor_digest(
                    take_columns(self.weights[name], request.columns(name, self.weights[name].shape[-1]))
                )
                for name in request.tensors
            }
        ]

    def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep({level})")
        self.asleep = True

    def wake_up(self) -> None:
        self.calls.append("wake_up")
        self.asleep = False

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


class TransportOnThisProcess:
    """The receiving end a ``RolloutWorker`` holds (``receiver.receive(engine)``), here the trainer's
    colocated transport run in this process over ``tensors``."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def receive(self, engine: RolloutEngine) -> SyncStats | None:
        transport = ColocatedTransport(
            rank=0,
            host_ranks=[0],
            engine=engine,
            layout=EngineLayout(tp=engine.num_workers),
            bucket_bytes=1 << 20,
        )
        return transport.send(TensorSource(self.tensors))


@pytest.fixture
def scripted_backend():
    built: list[dict] = []

    def build(model_dir: str, settings: EngineSettings, *, asynchronous: bool, partial_rollout: bool):
        built.append(dict(model_dir=model_dir, asynchronous=asynchronous, partial_rollout=partial_rollout))
        return ScriptedEngineDouble(model_dir, settings, asynchronous=asynchronous)

    backend = EngineBackend(
        name="scripted",
        build=build,
        options_from_config=lambda rollout: ScriptOptions(token_offset=rollout.response_length * 100),
    )
    register_backend(backend)
    yield built
    unregister_backend("scripted")


def test_the_rollout_worker_builds_and_drives_a_registered_backend(scripted_backend):
    config = load_config(QUICKSTART, ["rollout.name=scripted", "rollout.free_cache_engine=true"])
    worker = RolloutWorker(config, "/models/scripted", RankInfo(0, 1, "127.0.0.1", 29500))
    engine = worker.engine
    assert isinstance(engine, ScriptedEngineDouble)
    assert scripted_backend == [dict(model_dir="/models/scripted", asynchronous=False, partial_rollout=False)]
    # generic settings from the config, the backend's own options beside them
    assert engine.settings.options == ScriptOptions(token_offset=600)  # response_length 6 in the recipe
    assert engine.settings.max_model_len == 64 + 6  # data.max_prompt_length + rollout.response_length
    assert engine.settings.enable_sleep_mode and engine.settings.tensor_model_parallel_size == 1

    weights = {"w.a": torch.tensor([1.0, 2.0]), "w.b": torch.tensor([[4.0]])}  # sum 7
    worker.receiver = TransportOnThisProcess(weights)
    metrics = worker.receive_weights()
    assert metrics.pop(mk.WEIGHT_SYNC_VERIFY_SECONDS) > 0
    assert metrics == {
        mk.WEIGHT_SYNC_RECEIVE_SECONDS: 0.25,
        mk.WEIGHT_SYNC_BUCKETS: 1.0,
        # checked by default (sampled): the first sync into an engine, every tensor whole
        mk.WEIGHT_SYNC_CHECKSUM_MISMATCHES: 0.0,
        mk.WEIGHT_SYNC_VERIFIED_TENSORS: 2.0,
    }
    assert {n: t.tolist() for n, t in engine.weights.items()} == {"w.a": [1.0, 2.0], "w.b": [[4.0]]}

    out = worker.generate([[5, 7], [9]], SamplingConfig(n=2, response_length=3))
    base = 7 + 600
    assert out.response_ids == [
        [7 + base, 8 + base, 9 + base],
        [17 + base, 18 + base, 19 + base],
        [9 + base, 10 + base, 11 + base],
        [19 + base, 20 + base, 21 + base],
    ]
    assert out.response_logprobs == [[-0.25, -0.5, -0.75]] * 4
    assert out.prompt_ids == [[5, 7], [9]] and out.finish_reasons == ["length"] * 4
    # run_engine woke the engine, generated, and (rollout.free_cache_engine) put it back to sleep
    assert engine.calls == ["receive", "wake_up", "generate", "sleep(1)"]
    assert worker.generate([], SamplingConfig()) is None  # no prompts for this engine: not touched
    assert engine.calls[-1] == "sleep(1)"


def test_checksums_of_a_registered_backend_verify_through_the_protocol(scripted_backend):
    config = load_config(QUICKSTART, ["rollout.name=scripted"])
    engine = RolloutWorker(config, "/models/scripted", RankInfo(0, 1, "127.0.0.1", 29500)).engine
    weights = {"w.a": torch.tensor([1.0, 2.0]), "w.b": torch.tensor([[4.0]])}
    source = TensorSource(weights)
    transport = ColocatedTransport(
        rank=0, host_ranks=[0], engine=engine, layout=EngineLayout(tp=1), bucket_bytes=1 << 20
    )
    sender = WeightSender(source, transport, rank=0, host_ranks=[0], engine=engine, engine_tp=1, verify=True)
    metrics = sender.sync()
    assert metrics[mk.WEIGHT_SYNC_NUM_TENSORS] == 2.0 and metrics[mk.WEIGHT_SYNC_CHECKSUM_MISMATCHES] == 0.0
    engine.weights["w.b"] = torch.tensor([[5.0]])  # the engine holds something else than was sent
    (problem,) = sender.verify()
    assert problem.startswith("weight sync verification failed: w.b on engine rank 0 ")


def test_the_registry_knows_a_backend_only_while_registered(scripted_backend):
    assert backend_names() == ("scripted", "vllm")
    with pytest.raises(ValueError, match="rollout engine 'scripted' is already registered"):
        register_backend(EngineBackend(name="scripted", build=lambda *a, **k: None))
    with pytest.raises(ValueError, match="rollout engine 'vllm' is already registered"):
        register_backend(EngineBackend(name="vllm", build=lambda *a, **k: None))


def test_a_separate_engine_checks_what_it_was_handed_and_stops_on_a_wrong_slice(scripted_backend):
    """A separate engine verifies itself on receipt (``RolloutWorker.receive_weights``): the digests
    of the regions it was handed against what it reads back. A value changed in the engine after
    the load (a load that left a wrong slice) stops the sync in one line naming the tensor, the
    engine rank, the engine and the trainer rank that sent it."""
    from rltrain.errors import WeightSyncMismatchError

    config = load_config(QUICKSTART, ["rollout.name=scripted", "rollout.weight_sync.verify_every=2"])
    worker = RolloutWorker(config, "/models/scripted", RankInfo(3, 4, "127.0.0.1", 29500))
    weights = {"model.norm.weight": torch.tensor([1.0, 2.0]), "lm_head.weight": torch.tensor([[4.0]])}
    worker.receiver = TransportOnThisProcess(weights)
    engine = worker.engine
    real_receive = engine.receive

    def corrupting(updates, **kw):
        stats = real_receive(updates, **kw)
        engine.weights["lm_head.weight"][0, 0] += 1.0  # the engine took in something else
        return stats

    assert worker.receive_weights(step=0)[mk.WEIGHT_SYNC_VERIFIED_TENSORS] == 2.0
    # step 2: module 0 of 2 (the norm) is checked, the head is not: it passes
    engine.receive = corrupting
    assert worker.receive_weights(step=2)[mk.WEIGHT_SYNC_VERIFIED_TENSORS] == 1.0
    with pytest.raises(WeightSyncMismatchError) as stopped:
        worker.receive_weights(step=3)  # module 1: the head
    assert str(stopped.value) == (
        "weight sync verification failed: lm_head.weight on engine rank 0 (separate engine 3) differs "
        "from what trainer rank 0 sent (sha256 of its sampled columns, sync 3)"
    )
