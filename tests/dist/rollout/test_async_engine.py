"""``AsyncVllmEngine`` (a real ``AsyncLLM``, engine core in its own process) against the offline
in-process ``VllmEngine`` as the independent reference: the same samples bit for bit, concurrent
requests equal to one at a time, weight loads (digests of the tensors loaded, prefix cache reset),
sleep/wake on CPU, timeouts and a dead engine core that raise instead of hanging.

One async and one offline engine serve the module (``import vllm`` and the starts cost ~40 s here);
the weight test restores the checkpoint's weights in both before it returns."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

import pytest
import torch

from rltrain.rollout.protocol import EngineSettings

from rltrain.rollout.vllm.options import VllmOptions
from rltrain.rollout.types import SamplingConfig

pytestmark = [pytest.mark.dist, pytest.mark.e2e, pytest.mark.slow]

SETTINGS = EngineSettings(max_model_len=256, max_num_seqs=16, options=VllmOptions(kv_cache_space_gb=0.25))
PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 3, 150], [1, 340, 202, 371, 296, 224, 21], [11, 12, 13]]
SAMPLED = SamplingConfig(temperature=1.0, n=3, response_length=16, seed=7)
GREEDY = SamplingConfig(temperature=0.0, response_length=10)
LONG_PROMPT = [3 + (7 * i) % 390 for i in range(200)]  # spans full KV blocks: cacheable prefix


@pytest.fixture(scope="module")
def offline(model_dir):
    """The reference, started first: its in-process engine freezes vLLM's environment in this
    process, the case the async engine must cope with when both share a process."""
    from rltrain.rollout.vllm.engine import VllmEngine

    eng = VllmEngine(str(model_dir), settings=SETTINGS)
    assert eng.in_process
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def engine(model_dir, offline):
    from rltrain.rollout.vllm.async_engine import AsyncVllmEngine

    start = time.perf_counter()
    eng = AsyncVllmEngine(str(model_dir), settings=SETTINGS)
    print(f"AsyncVllmEngine start: {time.perf_counter() - start:.1f} s")
    assert not eng.in_process
    yield eng
    eng.shutdown()


def samples(out) -> list[tuple]:
    return list(zip(out.response_ids, out.response_logprobs, out.finish_reasons, out.stop_reasons))


def test_generate_equals_offline_engine_bit_for_bit(engine, offline):
    chat = [{"role": "user", "content": "What is 12 + 7?"}]
    prompts = [*PROMPTS, chat]
    ref = offline.generate(prompts, SAMPLED)
    # a stop token the samples reach: some end on it ("stop"), others run to the length limit
    stop_token = ref.response_ids[0][5]
    sampling = SamplingConfig(temperature=1.0, n=3, response_length=16, seed=7, stop_token_ids=(stop_token,))
    ref = offline.generate(prompts, sampling)
    out = engine.generate(prompts, sampling)
    assert out.prompt_ids == ref.prompt_ids and out.prompt_ids[-1] == offline.apply_chat_template(chat)
    assert out.n == 3 and out.num_samples == 3 * len(prompts)
    assert samples(out) == samples(ref)  # token ids, logprobs (floats compared exactly), finish, stop
    assert {"stop", "length"} <= set(out.finish_reasons) and stop_token in out.stop_reasons
    assert out.response_ids[0] != out.response_ids[1]  # sampled, not greedy


def test_many_concurrent_requests_equal_one_at_a_time(engine):
    requests = [
        (prompt, SamplingConfig(temperature=1.0, n=2, response_length=12, seed=seed))
        for prompt in PROMPTS
        for seed in (1, 2, 3, 4)
    ]
    assert len(requests) == 16

    async def concurrent():
        calls = [engine.agenerate(p, s, request_id=f"concurrent-{i}") for i, (p, s) in enumerate(requests)]
        return await asyncio.gather(*calls)

    async def one_at_a_time():
        return [await engine.agenerate(p, s, request_id=f"serial-{i}") for i, (p, s) in enumerate(requests)]

    together = engine.run(concurrent(), timeout_s=120, what="16 concurrent requests")
    alone = engine.run(one_at_a_time(), timeout_s=120, what="16 requests one at a time")
    # the same samples; logprobs to the last bits only: requests sent one by one share engine steps
    # as they happen to arrive, and a step's batch shape changes the kernels' sums
    assert [[(s.token_ids, s.finish_reason, s.stop_reason) for s in r] for r in together] == [
        [(s.token_ids, s.finish_reason, s.stop_reason) for s in r] for r in alone
    ]
    worst = max(
        abs(a - b)
        for r, r_alone in zip(together, alone)
        for s, s_alone in zip(r, r_alone)
        for a, b in zip(s.logprobs, s_alone.logprobs, strict=True)
    )
    assert worst < 1e-5
    assert all(len(s) == 2 for s in together)
    assert len({tuple(s[0].token_ids) for s in together}) > 8  # seeds and prompts give distinct samples


def greedy_with_cache_hits(engine, prompt: list[int]) -> tuple[int, tuple]:
    """One greedy request: (prompt tokens the engine took from its prefix cache, the sample)."""
    from vllm.sampling_params import RequestOutputKind

    from rltrain.rollout.vllm.engine import samples_of

    params = engine.core.sampling_params(GREEDY, output_kind=RequestOutputKind.FINAL_ONLY)

    async def one():
        final = None
        async for out in engine.async_llm.generate({"prompt_token_ids": prompt}, params, request_id="cache"):
            final = out
        return final

    final = engine.run(one(), timeout_s=60, what="a prefix-cache probe")
    (sample,) = samples_of(final)
    return final.num_cached_tokens, (
        sample.token_ids,
        sample.logprobs,
        sample.finish_reason,
        sample.stop_reason,
    )


def test_a_batch_reaches_the_engine_core_paused_and_starts_in_one_step(engine, offline, monkeypatch):
    """generate() sends its requests while the scheduler is paused, in prompt order, and resumes it
    after the last, as the offline engine adds a batch before its first step. Sent to a running
    scheduler, the first requests could take steps of their own, and a token's logprob then differed
    from the offline engine's in the last bits (seen once in CI). A request already in flight is
    paused for the moment and runs on to its end."""
    seen = []
    add_request = engine.async_llm.add_request

    async def recording(request_id, *args, **kwargs):
        seen.append((request_id, await engine.async_llm.is_paused()))  # ordered with the adds
        return await add_request(request_id, *args, **kwargs)

    def is_paused() -> bool:
        return engine.run(engine.async_llm.is_paused(), timeout_s=30, what="the pause state")

    monkeypatch.setattr(engine.async_llm, "add_request", recording)
    prompts = [*PROMPTS, LONG_PROMPT]
    reference = samples(offline.generate(prompts, GREEDY))
    out = engine.generate(prompts, GREEDY)
    name = seen[0][0].rsplit("-", 1)[0]
    assert seen == [(f"{name}-{i}", True) for i in range(len(prompts))]
    assert not is_paused()
    assert samples(out) == reference

    # a request in flight shares the batch's steps (so its floats may differ in the last bits)
    seen.clear()
    long_sampling = SamplingConfig(temperature=0.0, response_length=120)
    in_flight = asyncio.run_coroutine_threadsafe(
        engine.agenerate(PROMPTS[0], long_sampling, request_id="long"), engine.loop
    )
    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [("long", False)]
    time.sleep(0.2)  # generating
    out = engine.generate(prompts, GREEDY)
    assert [paused for _, paused in seen[1:]] == [True] * len(prompts) and not is_paused()
    assert out.response_ids == [ids for ids, *_ in reference]
    worst = max(
        abs(a - b) for lps, (_, ref, *_) in zip(out.response_logprobs, reference) for a, b in zip(lps, ref)
    )
    assert worst < 1e-5
    (long,) = in_flight.result(timeout=120)
    (alone,) = engine.run(engine.agenerate(PROMPTS[0], long_sampling, request_id="alone"), timeout_s=120)
    assert long.token_ids == alone.token_ids and long.finish_reason == alone.finish_reason
    assert len(long.token_ids) > 60  # it ran on after the batch's pause


def test_weight_load_equals_offline_engine_and_resets_prefix_cache(engine, offline, weights):
    from rltrain.weight_sync import checksum

    prompts = [*PROMPTS, LONG_PROMPT]
    before = engine.generate(prompts, GREEDY)
    assert samples(before) == samples(offline.generate(prompts, GREEDY))
    assert greedy_with_cache_hits(engine, LONG_PROMPT)[0] > 0  # the long prompt's blocks are cached now
    gen = torch.Generator().manual_seed(11)
    new = [(n, t + 0.05 * torch.randn(t.shape, generator=gen)) for n, t in weights]
    try:
        stats = engine.load_weights(new, bucket_bytes=64 << 10)  # several buckets, each a blob RPC
        offline.load_weights(new)
        assert stats.num_tensors == len(new) and stats.num_buckets > 1
        assert stats.num_bytes == sum(t.numel() * 4 for _, t in new)
        assert checksum.compare_digests(checksum.digests(new), engine.weights_digests()) == []
        assert engine.all_weights_digests() == [checksum.digests(new)]
        # the first request after the load finds no cached blocks (stale KV would skew its logprobs).
        # Both engines then run the same batches afresh: a cache hit, or the long prompt batched
        # with others instead of alone, changes its floats in the last bits.
        hits, long_after = greedy_with_cache_hits(engine, LONG_PROMPT)
        assert hits == 0
        assert [long_after] == samples(offline.generate([LONG_PROMPT], GREEDY))
        after = engine.generate(PROMPTS, GREEDY)
        assert samples(after) == samples(offline.generate(PROMPTS, GREEDY))
        assert after.response_ids != before.response_ids[: len(PROMPTS)]
        assert samples(engine.generate(PROMPTS, SAMPLED)) == samples(offline.generate(PROMPTS, SAMPLED))
    finally:
        engine.load_weights(weights)
        offline.load_weights(weights)
    assert engine.weights_digests() == checksum.digests(weights)
    assert samples(engine.generate(prompts, GREEDY)) == samples(before)  # restored bit for bit


def test_sleep_and_wake_up_on_cpu_are_the_logged_noop(engine, caplog):
    before = engine.generate(PROMPTS, SAMPLED)
    with caplog.at_level(logging.INFO, logger="rltrain.rollout.vllm.core"):
        for level in (1, 2):
            engine.sleep(level=level)
            assert not engine.asleep  # nothing released: generate() stays allowed
            engine.wake_up()
    logged = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert logged == [(logging.INFO, "rollout engine sleep/wake_up unsupported on CPU; skipped")]
    assert samples(engine.generate(PROMPTS, SAMPLED)) == samples(before)  # still serving, same samples


def test_run_timeout_names_what_it_waited_for(engine):
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"a ten-second nap did not finish within 0\.2 s"):
        engine.run(asyncio.sleep(10), timeout_s=0.2, what="a ten-second nap")
    assert time.perf_counter() - start < 2.0
    with pytest.raises(RuntimeError, match=r"must run on engine\.loop"):
        asyncio.run(engine.agenerate(PROMPTS[0], GREEDY, request_id="elsewhere"))
    assert engine.generate([PROMPTS[0]], GREEDY).finish_reasons == ["length"]  # the loop is free


def test_a_batch_whose_pause_is_not_answered_raises_and_leaves_the_engine_serving(engine, monkeypatch):
    """The engine core pauses but its answer comes late (a stand-in for a stuck engine core, which
    cannot be made on demand): the batch raises naming the pause, and the scheduler is resumed."""
    from rltrain.rollout.vllm import async_loop

    pause = engine.async_llm.pause_generation

    async def late_pause(**kwargs):
        await pause(**kwargs)
        await asyncio.sleep(30)

    monkeypatch.setattr(engine.async_llm, "pause_generation", late_pause)
    monkeypatch.setattr(async_loop, "CONTROL_TIMEOUT_S", 0.5)
    with pytest.raises(
        TimeoutError, match=r"pausing the scheduler to send a batch did not finish within 0\.5 s"
    ):
        engine.generate(PROMPTS, GREEDY)
    monkeypatch.undo()
    assert not engine.run(engine.async_llm.is_paused(), timeout_s=30, what="the pause state")
    assert engine.generate([PROMPTS[0]], GREEDY).finish_reasons == ["length"]


def test_dead_engine_core_raises_naming_the_engine(model_dir, engine):
    """A second engine (the shared one keeps serving): its engine core is killed mid-generation."""
    from rltrain.rollout.vllm.async_engine import AsyncVllmEngine

    doomed = AsyncVllmEngine(str(model_dir), settings=SETTINGS)
    outcome: dict[str, BaseException] = {}

    def generate() -> None:
        try:
            doomed.generate(PROMPTS * 4, SamplingConfig(temperature=1.0, n=4, response_length=240, seed=1))
        except BaseException as err:
            outcome["error"] = err

    thread = threading.Thread(target=generate)
    thread.start()
    time.sleep(1.0)
    (core,) = doomed.async_llm.engine_core.resources.engine_manager.processes
    os.kill(core.pid, signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive(), "generate() hung after the engine core died"
    assert isinstance(outcome.get("error"), RuntimeError), outcome
    assert f"async rollout engine ({model_dir})" in str(outcome["error"])
    assert "died" in str(outcome["error"])
    with pytest.raises(RuntimeError, match="died"):
        doomed.generate([PROMPTS[0]], GREEDY)
    start = time.perf_counter()
    doomed.shutdown()
    assert time.perf_counter() - start < 30
    assert engine.generate([PROMPTS[0]], GREEDY).finish_reasons == ["length"]
