"""Start-up of a group of local gloo ranks: fresh interpreters (``spawn``) against forks of a server
that has done the imports (``rltrain.local_ranks``), in one run.

    python bench/rank_startup.py --ranks 4 --repeats 3

Each launch starts ``--ranks`` processes that import what a conversion rank imports (torch,
Megatron-Core, transformers, rltrain's Megatron worker), join one gloo group and leave it; the time
is from the first ``start()`` to the last rank's answer. The two ways alternate launch by launch
(the first forkserver launch, which starts the server, is reported apart: a parent pays it once),
and the medians, their ratio and the load average are printed. The ranks are what
``rltrain convert`` and the test suite's gloo harness start.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rltrain.local_ranks import rank_context, rank_process
from rltrain.ports import HeldPort


def rank(rank_id: int, world: int, port: int, answers) -> None:
    import torch.distributed as dist

    import rltrain.megatron.worker  # noqa: F401  (what a rank imports first)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank_id, world_size=world)
    dist.barrier()
    dist.destroy_process_group()
    answers.put(rank_id)


def launch(ctx, world: int) -> float:
    answers = ctx.Queue()
    start = time.monotonic()
    with HeldPort("127.0.0.1") as port:
        procs = [rank_process(ctx, rank, r, world, port.port, answers) for r in range(world)]
        for proc in procs:
            proc.start()
        for _ in range(world):
            answers.get(timeout=600)
        elapsed = time.monotonic() - start
        for proc in procs:
            proc.join(timeout=60)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()} ({os.cpu_count()} CPUs)", flush=True)
    spawn, forked = multiprocessing.get_context("spawn"), rank_context()
    first_fork = launch(forked, args.ranks)
    print(f"forkserver, first launch (starts the server): {first_fork:.2f} s", flush=True)
    times: dict[str, list[float]] = {"spawn": [], "forkserver": []}
    for i in range(args.repeats):
        for name, ctx in (("spawn", spawn), ("forkserver", forked)):
            times[name].append(launch(ctx, args.ranks))
            print(f"launch {i + 1} {name}: {times[name][-1]:.2f} s", flush=True)
    a, b = statistics.median(times["spawn"]), statistics.median(times["forkserver"])
    print(
        f"{args.ranks} ranks, median of {args.repeats}: spawn {a:.2f} s, forkserver {b:.2f} s, "
        f"forkserver/spawn {b / a:.3f}"
    )
    print(f"load average after: {os.getloadavg()} ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
