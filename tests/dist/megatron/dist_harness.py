"""Run a function on several gloo ranks (spawned processes) and collect what each returns.

The function runs with the launcher environment set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
must be importable by name (defined at module level). An exception on any rank fails the caller with
that rank's traceback. Ranks are forks of a server that has imported torch, Megatron-Core and
transformers once (``rltrain.local_ranks``), each run in the environment of the moment it started.
"""

from __future__ import annotations

import os
import queue as queue_module
import traceback
from collections.abc import Callable
from typing import Any

from rltrain.local_ranks import rank_context, rank_process
from rltrain.ports import HeldPort


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        queue.put((rank, "ok", fn(*args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        raise


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300) -> list[Any]:
    """``fn(*args)`` on ``world_size`` ranks; returns the per-rank results in rank order."""
    ctx = rank_context()
    queue = ctx.Queue()
    port = HeldPort("127.0.0.1")  # held until the ranks are done, so nothing else takes it first
    procs = [
        rank_process(ctx, _entry, rank, world_size, port.port, fn, args, queue) for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for _ in range(world_size):
            # After a failure, give the other ranks a moment to report theirs (the root cause may be there).
            rank, status, value = queue.get(timeout=20 if errors else timeout_s)
            (errors if status == "error" else results)[rank] = value
    except queue_module.Empty:
        if not errors:
            raise AssertionError(
                f"ranks {sorted(set(range(world_size)) - set(results))} did not finish"
            ) from None
    finally:
        for proc in procs:
            proc.join(timeout=5 if errors else 30)
            if proc.is_alive():
                proc.kill()
        port.close()
    if errors:
        raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())))
    return [results[r] for r in range(world_size)]


def run_until_exit(fn: Callable, *args: Any, timeout_s: float = 300) -> int | None:
    """``fn(*args)`` on a single rank that is expected to die; returns its exit code."""
    ctx = rank_context()
    queue = ctx.Queue()  # kept referenced until the child has started
    with HeldPort("127.0.0.1") as port:
        proc = rank_process(ctx, _entry, 0, 1, port.port, fn, args, queue)
        proc.start()
        proc.join(timeout=timeout_s)
        if proc.is_alive():
            proc.kill()
    return proc.exitcode
