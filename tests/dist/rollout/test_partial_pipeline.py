"""Partial rollouts through the asynchronous pipeline (``AsyncSource`` with ``partial=True``, the
``one_step_off`` schedule) on a real ``AsyncVllmEngine``: the driver's loop (take, update, report,
refill) runs against ``EnginePolicy``, which stands in for ``PolicyRole`` and its separate engine
with the engine side's own pieces (``BatchQueue``, ``load_as_version``, what ``RolloutWorker`` runs)
and no Ray. Its weight send is the test's injected delay: it waits until the batch generating has
``INTERRUPT_AT`` tokens, so every update lands mid-batch.

References: the same step's batch generated uninterrupted on the same weights (tokens equal,
logprobs within 1e-5, as in test_partial_rollout.py), and versions and staleness counted by hand
from the per-token versions."""

from __future__ import annotations

import time

import pytest
import torch

from rltrain.data.prompt_rows import PromptExample
from rltrain.data.loader import PromptBatch
from rltrain.trainer.pipeline import AsyncSource
from rltrain.rollout.partial import BatchQueue, load_as_version
from rltrain.rollout.protocol import EngineSettings
from rltrain.rollout.vllm.options import VllmOptions
from rltrain.rollout.types import SamplingConfig

pytestmark = [pytest.mark.dist, pytest.mark.e2e, pytest.mark.slow]

SETTINGS = EngineSettings(max_model_len=256, max_num_seqs=16, options=VllmOptions(kv_cache_space_gb=0.25))
STEPS = 3
INTERRUPT_AT = 160
"""Tokens of a batch (8 samples of up to 96) sampled before a weight send may land."""
LOGPROB_ATOL = 1e-5
"""As in test_partial_rollout.py: a recomputed prefix's logits agree with the decode steps' to the
last bits on CPU; far below what a weight change gives."""


def sampling(step: int) -> SamplingConfig:
    """One request of 8 samples a batch (so an interrupted batch and its reference run engine steps
    alike: see test_partial_rollout.SAMPLED), a seed per step."""
    return SamplingConfig(temperature=1.0, n=8, response_length=96, seed=100 + step)


def prompt_of(position: int) -> list[int]:
    return [5, 17, 42, 99, 7 + position]


class EnginePolicy:
    """``PolicyRole`` with one separate engine, in process: ``queue_generate`` and
    ``sync_weights(version=...)`` as ``RolloutWorker.queue_batch`` / ``receive_weights`` run them;
    the actor's weights are ``self.weights`` (set by the test before each update)."""

    def __init__(self, engine, weights) -> None:
        self.engine, self.weights = engine, weights
        self.queue = BatchQueue(engine)
        self.sends: list[tuple[int | None, int]] = []
        """(version sent, tokens the batch generating had when the load began)."""

    def queue_generate(self, prompts, sampling):
        key = self.queue.submit(prompts, sampling)
        return _Queued(self.queue, key)

    def sync_weights(self, step: int, *, version: int | None = None) -> dict[str, float]:
        tokens = 0
        if version != self.engine.policy_version and self.queue.generating():
            tokens = self._wait_mid_batch()
        self.sends.append((version, tokens))
        load_as_version(self.engine, version, lambda: self.engine.load_weights(self.weights))
        return {"weight_sync/seconds": 0.0}

    def _wait_mid_batch(self) -> int:
        """The injected delay: the send waits until the batch generating has ``INTERRUPT_AT``
        tokens (and has not finished)."""
        deadline = time.monotonic() + 60
        while True:
            batch = self.queue.current
            if batch is not None and not batch.done() and batch.num_tokens >= INTERRUPT_AT:
                return batch.num_tokens
            assert time.monotonic() < deadline, "no batch reached INTERRUPT_AT tokens within 60 s"
            time.sleep(0.002)


class _Queued:
    def __init__(self, queue: BatchQueue, key: int) -> None:
        self.queue, self.key = queue, key

    def result(self):
        return self.queue.result(self.key)


@pytest.fixture(scope="module")
def engine(model_dir):
    from rltrain.rollout.vllm.async_engine import AsyncVllmEngine

    eng = AsyncVllmEngine(str(model_dir), settings=SETTINGS, partial_rollout=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def uninterrupted(engine):
    """Each step's batch on the checkpoint's weights, nothing in flight beside it."""
    return {
        step: flat(engine.start_batch([prompt_of(step - 1)], sampling(step)).results(timeout_s=120))
        for step in range(1, STEPS + 1)
    }


def flat(results) -> list:
    return [s for per_request in results for s in per_request]


def run_pipeline(policy: EnginePolicy, weights_after: dict[int, list]) -> tuple[dict, dict]:
    """The driver's loop over ``STEPS`` steps, resumed at the engine's version (a fresh source's
    first send must not go below the engine's label); the actor's weights after step ``k`` are
    ``weights_after[k]``. Returns the rollouts and the reports, by step (1-based)."""
    first = policy.engine.policy_version
    drawn = iter(range(1000))
    source = AsyncSource(
        policy,
        max_staleness=1,
        total_steps=first + STEPS,
        partial=True,
        next_prompts=lambda: _prompts(next(drawn)),
        engine_prompts=lambda p: [prompt_of(p.position)],
        sampling=lambda step: sampling(step - first),
    )
    source.start(first)
    source.refill()
    rollouts, reports = {}, {}
    for k in range(1, STEPS + 1):
        rollout = source.take(first + k)
        policy.weights = weights_after[k]
        source.after_update(first + k, updated=True)
        reports[k] = source.metrics(rollout, first + k)
        rollouts[k] = rollout
        source.refill()
    return rollouts, reports


def _prompts(position: int) -> PromptBatch:
    ex = PromptExample(
        index=position, prompt="p", ground_truth="", data_source="arithmetic", extra_info={}, origin="t:1"
    )
    return PromptBatch([ex], epoch=0, position=position)


def samples_of(rollout) -> list[tuple[list[int], list[float], list[int]]]:
    out = rollout.output
    return list(zip(out.response_ids, out.response_logprobs, out.token_versions))


def test_partial_rollout_with_unchanged_weights_repeats_the_uninterrupted_batches(
    engine, weights, uninterrupted
):
    policy = EnginePolicy(engine, weights)
    first = engine.policy_version
    rollouts, reports = run_pipeline(policy, {k: weights for k in range(1, STEPS + 1)})
    # every step's send landed mid-batch (batches 2 and 3 were generating)
    assert [v for v, _ in policy.sends] == [first, first + 1, first + 2, first + 3]
    assert all(tokens >= INTERRUPT_AT for _, tokens in policy.sends[1:3]) and policy.sends[3][1] == 0
    interrupted = 0
    for k in range(1, STEPS + 1):
        got, ref = samples_of(rollouts[k]), uninterrupted[k]
        assert [ids for ids, _, _ in got] == [s.token_ids for s in ref]
        worst = max(abs(a - b) for (_, lps, _), s in zip(got, ref) for a, b in zip(lps, s.logprobs))
        assert worst <= LOGPROB_ATOL, (k, worst)
        assert rollouts[k].output.finish_reasons == [s.finish_reason for s in ref]
        interrupted += sum(v[0] != v[-1] for _, _, v in got)
    assert interrupted >= 8, "the re-sent weights landed in the middle of samples"
    # the labels moved on although the weights did not: batches 2 and 3 are one version old at
    # their oldest token
    assert [reports[k]["async/staleness_max"] for k in range(1, STEPS + 1)] == [0.0, 1.0, 1.0]


def test_weights_changing_mid_batch_version_tokens_and_bound_the_oldest(engine, weights, uninterrupted):
    gen = torch.Generator().manual_seed(11)
    new = {k: [(n, t + 0.05 * torch.randn(t.shape, generator=gen)) for n, t in weights] for k in (1, 2)}
    policy = EnginePolicy(engine, weights)
    first = engine.policy_version
    try:
        rollouts, reports = run_pipeline(policy, {1: new[1], 2: new[2], 3: weights})
    finally:
        with engine.weight_update(version=engine.policy_version + 1):
            engine.load_weights(weights)
    # batch 1 ran before any update: all of it on the first version (and the checkpoint's sample)
    assert all(v == [first] * len(v) for _, _, v in samples_of(rollouts[1]))
    assert [ids for ids, _, _ in samples_of(rollouts[1])] == [s.token_ids for s in uninterrupted[1]]
    for k in (2, 3):
        old, later = first + k - 2, first + k - 1  # generated from step k-2's weights, step k-1's landed
        got = samples_of(rollouts[k])
        for ids, _, versions in got:
            assert len(versions) == len(ids) and set(versions) <= {old, later}
            assert versions == sorted(versions), "non-decreasing along the response"
        crossed = [v for _, _, v in got if v[0] != v[-1]]
        assert len(crossed) >= 4, f"step {k}: the update landed mid-batch in {len(crossed)} samples"
        assert {x for _, _, v in got for x in v} == {old, later}
        # hand-counted staleness at step first+k: a sample's is its oldest token's
        sample_staleness = [first + k - 1 - v[0] for _, _, v in got]
        tokens = [first + k - 1 - x for _, _, v in got for x in v]
        assert rollouts[k].version == old and max(sample_staleness) == 1 <= 1  # the bound, oldest token
        report = reports[k]
        assert report["async/staleness_max"] == 1.0
        assert report["async/staleness_mean"] == pytest.approx(sum(sample_staleness) / len(got))
        assert report["async/partial_samples"] == pytest.approx(len(crossed) / len(got))
        assert report["async/version_spread"] == 1.0
        assert report["async/token_staleness_mean"] == pytest.approx(sum(tokens) / len(tokens))
        assert report["async/token_staleness_mean"] < report["async/staleness_mean"]
    # batch 2's prefix is the checkpoint weights' sample, kept as it was; its rest is the new weights'
    changed = 0
    for (ids, lps, versions), ref in zip(samples_of(rollouts[2]), uninterrupted[2]):
        split = versions.index(first + 1) if first + 1 in versions else len(ids)
        assert ids[:split] == ref.token_ids[:split]
        assert (
            max((abs(a - b) for a, b in zip(lps[:split], ref.logprobs[:split])), default=0.0) <= LOGPROB_ATOL
        )
        changed += ids[split:] != ref.token_ids[split:]
    assert changed >= 1, "the new weights sampled something else after the update"
