"""The asynchronous engine's event loop: ``EngineLoop``, a background thread running the asyncio
loop that ``AsyncLLM`` lives on, with every wait from sync code bounded; and ``AsyncCalls``, the
engine's control calls (``EngineCalls``: RPCs, prefix-cache reset, sleep / wake) run on that loop.

Every wait is bounded: control calls by ``CONTROL_TIMEOUT_S``, other waits (generation) by the
engine's liveness, checked every ``_POLL_S``; a dead engine or a timeout raises an error naming the
engine and what was awaited, never hangs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

START_TIMEOUT_S = 600.0
"""Engine start (engine core process up, model loaded, KV cache allocated)."""

CONTROL_TIMEOUT_S = 600.0
"""One control call: a weight bucket or digest RPC, a cache reset, sleep / wake_up, shutdown."""

_POLL_S = 0.5
"""How often a wait without a deadline checks that the engine is alive."""


class EngineLoop:
    """An asyncio event loop on a thread of its own; ``describe`` names the engine in errors,
    ``errored`` says whether the engine on the loop has died."""

    def __init__(self, describe: str, errored: Callable[[], bool]) -> None:
        self.describe = describe
        self._errored = errored
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="rltrain-async-engine", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def on_loop(self) -> bool:
        """Whether the caller runs on the loop's thread (where a blocking wait would deadlock)."""
        return threading.current_thread() is self._thread

    def alive(self) -> bool:
        return self._thread.is_alive()

    def dead(self) -> bool:
        return not self._thread.is_alive() or self._errored()

    def run(self, coro: Coroutine[Any, Any, T], *, timeout_s: float | None = None, what: str = "a call") -> T:
        """Run ``coro`` on the loop from sync code and return its result. ``timeout_s`` None waits
        as long as the engine lives; a timeout raises ``TimeoutError`` naming ``what``."""
        if self.on_loop():
            coro.close()
            raise RuntimeError(f"{self.describe}: run() called on the engine loop; await {what} instead")
        if not self._thread.is_alive():
            coro.close()
            raise RuntimeError(f"{self.describe}: the engine is shut down; cannot run {what}")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.wait_first({future}, deadline=deadline, timeout_s=timeout_s, what=what)
        return self.result(future, what)

    def wait_first(
        self,
        pending: set[concurrent.futures.Future],
        *,
        deadline: float | None,
        timeout_s: float | None,
        what: str,
    ) -> set[concurrent.futures.Future]:
        """Wait until one of ``pending`` is done (returns those done), the engine dies or ``deadline``
        passes; the last two cancel ``pending`` and raise naming ``what``."""
        if self.on_loop():
            raise RuntimeError(f"{self.describe}: waiting for {what} on the engine loop would block it")
        while True:
            left = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
            done, _ = concurrent.futures.wait(pending, timeout=left, return_when="FIRST_COMPLETED")
            if done:
                return done
            if self.dead():
                for future in pending:
                    future.cancel()
                raise RuntimeError(f"{self.describe}: the engine died while waiting for {what}")
            if deadline is not None and time.monotonic() >= deadline:
                for future in pending:
                    future.cancel()
                raise TimeoutError(f"{self.describe}: {what} did not finish within {timeout_s:g} s")

    def result(self, future: concurrent.futures.Future, what: str) -> Any:
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            return future.result()
        except EngineDeadError as err:
            raise RuntimeError(f"{self.describe}: the engine core died during {what}") from err

    async def within(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        """Await ``coro`` on the loop for at most ``CONTROL_TIMEOUT_S``; a timeout raises naming ``what``."""
        timeout_s = CONTROL_TIMEOUT_S
        try:
            return await asyncio.wait_for(coro, timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{self.describe}: {what} did not finish within {timeout_s:g} s") from None

    def control(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        """``run`` bounded by ``CONTROL_TIMEOUT_S``."""
        return self.run(coro, timeout_s=CONTROL_TIMEOUT_S, what=what)

    def shutdown(self, stop: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``stop()`` on the loop (no liveness check: a dead engine is shut down too), then stop
        the loop; each within ``CONTROL_TIMEOUT_S``."""
        future = asyncio.run_coroutine_threadsafe(stop(), self.loop)
        try:
            future.result(timeout=CONTROL_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"{self.describe}: the engine shutdown did not finish within {CONTROL_TIMEOUT_S:g} s"
            ) from None
        finally:
            self.stop(join_timeout_s=CONTROL_TIMEOUT_S)

    def stop(self, *, join_timeout_s: float) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=join_timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


class AsyncCalls:
    """``EngineCalls`` on an ``AsyncLLM``: each call run on the engine loop and bounded by
    ``CONTROL_TIMEOUT_S``."""

    def __init__(self, loop: EngineLoop, async_llm: Any) -> None:
        self._loop, self._async_llm = loop, async_llm

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
        rpc = self._async_llm.collective_rpc(method, timeout=CONTROL_TIMEOUT_S, args=args, kwargs=kwargs)
        return self._loop.control(rpc, f"collective_rpc({name})")

    def reset_prefix_cache(self) -> None:
        if not self._loop.control(self._async_llm.reset_prefix_cache(), "the prefix-cache reset"):
            # vLLM refuses while requests run: their cached blocks would outlive the weights they hold
            raise RuntimeError(
                f"{self._loop.describe}: prefix-cache reset refused while requests are running; "
                "load weights between generations"
            )

    def sleep(self, level: int = 1) -> None:
        self._loop.control(self._async_llm.sleep(level), f"sleep(level={level})")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._loop.control(self._async_llm.wake_up(tags), f"wake_up(tags={tags})")
