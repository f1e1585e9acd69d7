"""Who holds the asynchronous engine's scheduler paused: ``SchedulerPauses``, the pause of a batch
being sent (its requests start in one step) and the pause of a weight update while requests are in
flight (partial rollouts), with the policy version the serving weights are labelled with.

The contract of a weight update (``weight_update``) is in ``async_engine``'s docstring; every call
on the ``AsyncLLM`` here is bounded by the engine loop (``async_loop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any

from rltrain.rollout.vllm import async_loop
from rltrain.rollout.vllm.async_loop import EngineLoop


class SchedulerPauses:
    """The pause state of one ``AsyncLLM``'s scheduler (``async_llm``, set once it has started)."""

    def __init__(self, loop: EngineLoop, *, partial_rollout: bool) -> None:
        self._loop = loop
        self.async_llm: Any = None
        self.partial_rollout = partial_rollout  # rollout.partial_rollout, read at each weight_update
        self.policy_version = 0  # the version of the weights serving now; weight_update sets it
        self._update_lock = threading.Lock()
        # Held (on the loop) while the scheduler's pause state changes: a batch's own pause and
        # resume (for_batch) never interleave with a weight update's.
        self._scheduler_lock = asyncio.Lock()
        self._paused_for_update = False

    @contextlib.asynccontextmanager
    async def for_batch(self) -> AsyncIterator[None]:
        """On the loop: the scheduler paused while a batch's requests are sent, so that its next step
        schedules them all at once (within a weight update it is paused already)."""
        async with self._scheduler_lock:
            pause_here = not self._paused_for_update
            try:
                if pause_here:
                    pause = self.async_llm.pause_generation(mode="keep", clear_cache=False)
                    await self._loop.within(pause, "pausing the scheduler to send a batch")
                yield
            finally:  # also after a pause that timed out: the engine core may have paused since
                if pause_here and not self.async_llm.errored:
                    resume = self.async_llm.resume_generation()
                    await self._loop.within(resume, "resuming the scheduler after sending a batch")

    @contextlib.contextmanager
    def weight_update(self, *, version: int, timeout_s: float | None = None) -> Iterator[None]:
        """``AsyncVllmEngine.weight_update`` (``timeout_s`` None: ``CONTROL_TIMEOUT_S``)."""
        timeout_s = async_loop.CONTROL_TIMEOUT_S if timeout_s is None else timeout_s
        describe = self._loop.describe
        if not self._update_lock.acquire(blocking=False):
            raise RuntimeError(f"{describe}: weight_update(version={version!r}) while another is in progress")
        try:
            if not isinstance(version, int) or version <= self.policy_version:
                raise ValueError(
                    f"{describe}: weight_update(version={version!r}) needs an int above the "
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
            self._loop.run(self._pause_for_update_async(mode, clear_cache), timeout_s=timeout_s, what=what)
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

    def _control(self, coro: Coroutine[Any, Any, Any], what: str) -> Any:
        return self._loop.control(coro, what)
