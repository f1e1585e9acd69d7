"""Benchmark: peak memory of vocab-parallel logprobs+entropy vs the naive full-logits path (49k vocab).

Two gloo ranks (TP=2) each hold their half of the logits, [tokens, 49152 / 2] fp32, and compute
per-token logprobs and entropy, forward and backward:

* ``vocab_parallel``: ``rltrain.megatron.logprobs`` (max / sum-exp / target logit reduced over TP);
* ``naive``: all-gather the full [tokens, 49152] logits on every rank, ``log_softmax``, gather,
  entropy (what a trainer without a vocab-parallel path does).

Each path runs in fresh processes; the peak is rank 0's ``ru_maxrss`` minus its RSS just before the
computation (the local logits already allocated). Prints both peaks and their ratio.

Usage (from the repository root): python -m bench.megatron_logprob_memory [--tokens 2048]
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import time

import torch
import torch.multiprocessing as mp

VOCAB = 49152


def _rank(rank: int, world: int, port: int, mode: str, tokens: int, queue: mp.Queue) -> None:
    import psutil
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_fn

    from rltrain.megatron.logprobs import vocab_parallel_logprobs_entropy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    local = torch.randn(tokens, VOCAB // world, generator=gen).requires_grad_()
    targets = torch.randint(0, VOCAB, (tokens,), generator=torch.Generator().manual_seed(7))
    dist.barrier()
    before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    if mode == "vocab_parallel":
        logprobs, entropy = vocab_parallel_logprobs_entropy(
            local, targets, tp_group=dist.group.WORLD, tp_rank=rank
        )
    else:
        full = torch.cat(dist_fn.all_gather(local), dim=-1)
        log_p = torch.log_softmax(full, dim=-1)
        logprobs = log_p.gather(-1, targets[:, None]).squeeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
    (logprobs.sum() + entropy.sum()).backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    queue.put((rank, peak, seconds))
    dist.destroy_process_group()


def _measure(mode: str, tokens: int) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, 2, port, mode, tokens, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict((r, (p, s)) for r, p, s in (queue.get(timeout=600) for _ in procs))
    for proc in procs:
        proc.join()
    return results[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    full_mb = args.tokens * VOCAB * 4 / 2**20
    print(f"tokens={args.tokens} vocab={VOCAB} TP=2; one full fp32 logits tensor = {full_mb:.0f} MiB")
    peaks = {}
    for mode in ("naive", "vocab_parallel"):
        peak, seconds = _measure(mode, args.tokens)
        peaks[mode] = peak
        print(
            f"{mode:>15}: rank-0 peak above baseline {peak / 2**20:8.0f} MiB ({peak / 2**20 / full_mb:.2f}× full logits), {seconds:.2f} s"
        )
    print(f"vocab_parallel / naive peak memory: {peaks['vocab_parallel'] / peaks['naive']:.3f}")


if __name__ == "__main__":
    main()
