"""Benchmark: causal attention of one long sequence at CP=1 vs CP=2 (the CPU path), forward + backward.

* ``cp1``: one process, ``packed_causal_attention`` over the whole sequence (SDPA, ``is_causal``).
* ``cp2``: two gloo processes, each holding chunks r and 3−r of the sequence (Megatron's load
  balancing, ``context_parallel_index``): K/V all-gathered over the pair
  (``local_spec.gather_sequence_over_cp``, whose backward sums the K/V gradients), then
  ``context_parallel_causal_attention`` of the rank's queries; the gradient of q/k/v comes back.

Shapes are SmolLM2-135M's attention (9 query heads, 3 KV groups, head dim 64), fp32, one torch
thread per process (CP=2 uses both cores, CP=1 one). Each (mode, length) runs in fresh processes:
one warm-up pass, then the best of ``--repeats`` timed passes. Memory is each rank's peak RSS
above its RSS just before the first pass (inputs already allocated; the all-gathered K/V counts).
Time per token is the slowest rank's wall time over the sequence's tokens. Prints, per length, both
modes and the CP=2 / CP=1 ratios, and the load average before and after (a busy machine inflates
times).

Usage (from the repository root): python -m bench.cp_attention [--tokens 2048 4096 8192]
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
import torch.multiprocessing as mp

HEADS, GROUPS, DIM = 9, 3, 64
SCALE = DIM**-0.5


def _inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, HEADS, DIM, generator=gen)
    k, v = (torch.randn(tokens, GROUPS, DIM, generator=gen) for _ in range(2))
    return q, k, v, torch.randn(tokens, HEADS, DIM, generator=gen)


def _rank(rank: int, world: int, port: int, tokens: int, repeats: int, queue: mp.Queue) -> None:
    import warnings

    warnings.filterwarnings("ignore")  # Megatron's "Apex is not installed" on import
    import psutil
    import torch.distributed as dist

    from rltrain.data.packing import context_parallel_index
    from rltrain.megatron.local_spec import gather_sequence_over_cp
    from rltrain.megatron.packed_attention import context_parallel_causal_attention, packed_causal_attention

    torch.set_num_threads(1)
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    q, k, v, weight = _inputs(tokens)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        index = context_parallel_index(cu, cp_size=world, cp_rank=rank)
        q, k, v, weight = (t[index].contiguous() for t in (q, k, v, weight))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def one_pass() -> None:
        if world == 1:
            out = packed_causal_attention(q, k, v, cu, scale=SCALE)
        else:
            full_k, full_v = (gather_sequence_over_cp(t, cu, dist.group.WORLD) for t in (k, v))
            out = context_parallel_causal_attention(
                q, full_k, full_v, cu, cp_size=world, cp_rank=rank, scale=SCALE
            )
        (out * weight).sum().backward()
        for t in (q, k, v):
            t.grad = None

    before = psutil.Process().memory_info().rss
    one_pass()
    best = float("inf")
    for _ in range(repeats):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    queue.put((rank, peak, best))
    if world > 1:
        dist.destroy_process_group()


def _measure(world: int, tokens: int, repeats: int) -> tuple[float, float]:
    """(largest per-rank peak bytes, slowest rank's best seconds)."""
    from rltrain.ports import HeldPort

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    held = HeldPort("127.0.0.1")  # held until the ranks are done, so nothing else takes it first
    procs = [
        ctx.Process(target=_rank, args=(r, world, held.port, tokens, repeats, queue)) for r in range(world)
    ]
    for proc in procs:
        proc.start()
    try:
        results = [queue.get(timeout=900) for _ in procs]  # timeout: a rank that never reports
    finally:
        for proc in procs:
            proc.join(timeout=60)
        held.close()
    return max(p for _, p, _ in results), max(s for _, _, s in results)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"attention: {HEADS} heads, {GROUPS} KV groups, head dim {DIM}, fp32, forward + backward")
    header = f"{'tokens':>7} {'mode':>4} {'peak MiB/rank':>14} {'KiB/token':>10} {'s':>8} {'µs/token':>9}"
    print(header)
    rows = []
    for tokens in args.tokens:
        measured = {}
        for world in (1, 2):
            peak, seconds = _measure(world, tokens, args.repeats)
            measured[world] = (peak, seconds)
            print(
                f"{tokens:>7} {f'cp{world}':>4} {peak / 2**20:>14.1f} {peak / 2**10 / tokens:>10.2f} "
                f"{seconds:>8.3f} {seconds / tokens * 1e6:>9.1f}"
            )
        rows.append((tokens, measured[2][0] / measured[1][0], measured[2][1] / measured[1][1]))
    print("CP=2 / CP=1:")
    for tokens, memory, seconds in rows:
        print(f"{tokens:>7} tokens: peak memory per rank {memory:.2f}×, time {seconds:.2f}×")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
