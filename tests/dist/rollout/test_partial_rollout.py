"""Partial rollouts on a real ``AsyncVllmEngine`` (engine core in its own process): a weight
update lands while a batch of seeded requests generates, and each test checks the outcome against an
independent reference: the same batch uninterrupted (the same tokens; logprobs within 1e-5, bit for
bit when the engine steps are alike), and the new
weights' own log-probabilities of the same tokens (vLLM's prompt logprobs of prompt + response, a
prefill of the whole sequence instead of the decode steps that sampled it).

One engine serves the module; each test that changes weights restores the checkpoint's before it
returns, and sets ``engine.partial_rollout`` for itself."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from rltrain.rollout.protocol import EngineSettings

from rltrain.rollout.vllm.options import VllmOptions
from rltrain.rollout.types import SamplingConfig

pytestmark = [pytest.mark.dist, pytest.mark.e2e, pytest.mark.slow]

SETTINGS = EngineSettings(max_model_len=256, max_num_seqs=16, options=VllmOptions(kv_cache_space_gb=0.25))
PROMPTS = [[5, 17, 42, 99, 7]]
SAMPLED = SamplingConfig(temperature=1.0, n=8, response_length=96, seed=7)
"""One request of 8 samples: they enter the engine in one step, so every run of the batch shares its
engine steps alike. On CPU a request's floats (and so its seeded samples) depend on what shares its
steps (a prefill beside a decode, another row count for the GEMMs); separate requests would arrive
in steps that depend on timing, and exact comparisons between runs would be luck."""
INTERRUPT_AT = 160
"""Tokens of the batch (8 samples of up to 96) sampled before the weight update lands."""
VERSIONS = itertools.count(1)


@pytest.fixture(scope="module")
def new_weights(weights) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    return [(n, t + 0.05 * torch.randn(t.shape, generator=gen)) for n, t in weights]


@pytest.fixture(scope="module")
def engine(model_dir):
    from rltrain.rollout.vllm.async_engine import AsyncVllmEngine

    eng = AsyncVllmEngine(str(model_dir), settings=SETTINGS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def uninterrupted(engine):
    """The batch on the checkpoint's weights, no update in flight."""
    return engine.start_batch(PROMPTS, SAMPLED).results(timeout_s=120)


def wait_for_tokens(batch, num_tokens: int) -> None:
    deadline = time.monotonic() + 60
    while batch.num_tokens < num_tokens:
        assert not batch.done(), f"the batch finished with {batch.num_tokens} tokens"
        assert time.monotonic() < deadline, f"{batch.num_tokens} of {num_tokens} tokens after 60 s"
        time.sleep(0.002)


def flat(results) -> list:
    return [s for per_request in results for s in per_request]


def sampled(results) -> list[tuple]:
    """What a sample is without its versions and logprobs: tokens, finish and stop reasons."""
    return [(s.token_ids, s.finish_reason, s.stop_reason) for s in flat(results)]


LOGPROB_ATOL = 1e-5
"""Logprobs of the same tokens under the same weights, computed in other engine steps (a decode
step, or the prefill that recomputes a paused prefix), agree to the last bits on CPU only when the
steps are alike; the tolerance is far below any weight change (the new-weights test sees > 1e-2)."""


def assert_same_samples(results, reference) -> None:
    """The same tokens, finish and stop reasons as ``reference``, logprobs within ``LOGPROB_ATOL``."""
    assert sampled(results) == sampled(reference)
    worst = max(
        (abs(a - b) for s, r in zip(flat(results), flat(reference)) for a, b in zip(s.logprobs, r.logprobs)),
        default=0.0,
    )
    assert worst <= LOGPROB_ATOL, worst


def restore(engine, weights) -> None:
    with engine.weight_update(version=next(VERSIONS)):
        engine.load_weights(weights)


def scored_logprobs(engine, prompt: list[int], response: list[int]) -> list[float]:
    """The engine's current weights' logprob of each response token after prompt + the tokens before
    it (prompt logprobs of one prefill)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

    async def score():
        final = None
        async for out in engine.async_llm.generate(
            {"prompt_token_ids": prompt + response}, params, request_id=f"score-{time.monotonic_ns()}"
        ):
            final = out
        return final

    final = engine.run(score(), timeout_s=60, what="scoring a response")
    steps = final.prompt_logprobs[len(prompt) :]
    return [step[token].logprob for token, step in zip(response, steps)]


def test_partial_rollout_with_unchanged_weights_equals_uninterrupted(engine, weights, uninterrupted):
    engine.partial_rollout = True
    old = engine.policy_version
    batch = engine.start_batch(PROMPTS, SAMPLED)
    wait_for_tokens(batch, INTERRUPT_AT)
    new = next(VERSIONS)
    with engine.weight_update(version=new):
        stats = engine.load_weights(weights)  # the same weights, through the real load
    assert stats.num_tensors == len(weights) and engine.policy_version == new
    results = batch.results(timeout_s=120)
    # the acceptance check: tokens, logprobs (floats compared exactly), finish and stop reasons
    assert_same_samples(results, uninterrupted)
    got, ref = flat(results), flat(uninterrupted)
    assert all(set(s.versions) == {old} for s in ref)
    interrupted = [s for s in got if s.num_interruptions == 1]
    assert len(interrupted) >= 4  # the update landed mid-generation
    for s in interrupted:
        split = s.versions.index(new)
        assert 0 < split < len(s.token_ids) and s.versions == [old] * split + [new] * (
            len(s.versions) - split
        )
    assert all(s.versions == [old] * len(s.versions) for s in got if s.num_interruptions == 0)


def test_partial_rollout_with_new_weights_keeps_prefix_and_versions_new_tokens(
    engine, weights, new_weights, uninterrupted
):
    engine.partial_rollout = True
    old = engine.policy_version
    batch = engine.start_batch(PROMPTS, SAMPLED)
    wait_for_tokens(batch, INTERRUPT_AT)
    new = next(VERSIONS)
    try:
        with engine.weight_update(version=new):
            engine.load_weights(new_weights)
        got = batch.results(timeout_s=120)
        checked = 0
        for p, (per_request, ref_request) in enumerate(zip(got, uninterrupted)):
            for s, ref in zip(per_request, ref_request):
                split = s.versions.index(new) if new in s.versions else len(s.versions)
                assert s.versions == [old] * split + [new] * (len(s.versions) - split)
                # the prefix is the old weights' sample, kept as it was
                assert s.token_ids[:split] == ref.token_ids[:split]
                assert (
                    max((abs(a - b) for a, b in zip(s.logprobs[:split], ref.logprobs[:split])), default=0)
                    <= LOGPROB_ATOL
                )
                if split == len(s.token_ids):
                    continue  # finished before the update
                checked += 1
                scored = scored_logprobs(engine, PROMPTS[p], s.token_ids)
                # new tokens: the new weights' logprobs (decode steps vs one prefill: last bits)
                assert max(abs(a - b) for a, b in zip(s.logprobs[split:], scored[split:])) < 1e-5
                # the prefix is not what the new weights give (so the check above can fail)
                assert max(abs(a - b) for a, b in zip(s.logprobs[:split], scored[:split])) > 1e-2
        assert checked >= 4
    finally:
        restore(engine, weights)


def test_finish_mode_completes_on_old_weights_before_the_load(engine, weights, new_weights, uninterrupted):
    engine.partial_rollout = False
    old = engine.policy_version
    batch = engine.start_batch(PROMPTS, SAMPLED)
    wait_for_tokens(batch, INTERRUPT_AT)
    new = next(VERSIONS)
    late_prompt = [PROMPTS[0]]
    late_sampling = SamplingConfig(temperature=1.0, n=2, response_length=24, seed=3)
    try:
        with engine.weight_update(version=new):
            # every request in flight finished before the load: its results arrive with the old
            # weights still in place (the client side may take a moment to receive the last outputs)
            results = batch.results(timeout_s=10)
            late = engine.start_batch(late_prompt, late_sampling)  # waits for the new weights
            engine.load_weights(new_weights)
        assert_same_samples(results, uninterrupted)
        got = flat(results)
        assert all(s.versions == [old] * len(s.token_ids) for s in got)
        late_got = flat(late.results(timeout_s=60))
        assert all(s.versions == [new] * len(s.token_ids) for s in late_got)
        # ... sampled by the new weights: the same samples as the request made afterwards
        again = flat(engine.start_batch(late_prompt, late_sampling).results(timeout_s=60))
        assert_same_samples([late_got], [again])
        old_weights_run = flat(uninterrupted)[:2]
        assert [s.logprobs[:4] for s in late_got] != [s.logprobs[:4] for s in old_weights_run]
    finally:
        restore(engine, weights)


def test_waits_are_bounded_and_name_what_they_waited_for(engine, uninterrupted):
    engine.partial_rollout = False
    version = engine.policy_version
    too_old = pytest.raises(ValueError, match=rf"needs an int above the current policy version {version}")
    with too_old, engine.weight_update(version=version):
        pytest.fail("weight_update accepted a version that is not above the current one")
    busy = pytest.raises(RuntimeError, match=r"weight_update\(version=\d+\) while another is in progress")
    with engine.weight_update(version=next(VERSIONS)), busy, engine.weight_update(version=next(VERSIONS)):
        pytest.fail("a second weight_update ran inside the first")
    version = engine.policy_version
    batch = engine.start_batch(PROMPTS, SAMPLED)
    wait_for_tokens(batch, 40)
    start = time.perf_counter()
    with (
        pytest.raises(
            TimeoutError,
            match=r"async rollout engine \(.*\): the requests in flight to finish on the old weights "
            r"\(rollout\.partial_rollout=false\) did not finish within 0\.05 s",
        ),
        engine.weight_update(version=next(VERSIONS), timeout_s=0.05),
    ):
        pytest.fail("the block ran although the pause timed out")
    assert time.perf_counter() - start < 5 and engine.policy_version == version
    # the engine resumed: the batch completes as if nothing happened
    assert_same_samples(batch.results(timeout_s=120), uninterrupted)
    slow = engine.start_batch(PROMPTS, SAMPLED)
    with pytest.raises(
        TimeoutError, match=r"batch-\d+: 1 of 1 requests \(batch-\d+-0.*did not finish within 0\.01 s"
    ):
        slow.results(timeout_s=0.01)
    # an error inside the block aborts the requests in flight and the engine serves on
    engine.partial_rollout = True
    doomed = engine.start_batch(PROMPTS, SAMPLED)
    wait_for_tokens(doomed, 40)
    with pytest.raises(OSError, match="transport lost"), engine.weight_update(version=next(VERSIONS)):
        raise OSError("transport lost")
    aborted = flat(doomed.results(timeout_s=30))
    assert engine.policy_version == version
    # a sample that reached its end before the error stays whole (how many did depends on timing);
    # every other one is aborted with a prefix of what it would have sampled
    for got, whole in zip(aborted, flat(uninterrupted), strict=True):
        if got.finish_reason == "abort":
            assert got.token_ids == whole.token_ids[: len(got.token_ids)]
        else:
            assert (got.token_ids, got.finish_reason) == (whole.token_ids, whole.finish_reason)
    assert sum(s.finish_reason == "abort" for s in aborted) > 0
    assert_same_samples(engine.start_batch(PROMPTS, SAMPLED).results(timeout_s=120), uninterrupted)
