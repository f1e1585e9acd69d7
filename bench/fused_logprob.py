"""Benchmark: peak memory and time of the LM head + logprobs + entropy step, fused vs unfused.

One step is forward + backward of ``(logprobs · w1 + entropy · w2).sum()`` from the final hidden
states ``[tokens, hidden]`` and this rank's LM-head shard ``[vocab / tp, hidden]`` (float32, CPU):

* ``unfused``: the current path, ``logits = hidden @ weight.T`` ([tokens, vocab/tp] materialised)
  → ``rltrain.megatron.logprobs.vocab_parallel_logprobs_entropy``; at TP=2 the hidden gradient is
  all-reduced afterwards, as Megatron's column-parallel output layer does;
* ``fused``: ``kernels.fused_logprob.fused_logprobs_entropy`` (torch path; chunks of at most
  ``--chunk-size`` tokens, default ``CHUNK_ELEMENTS // (vocab/tp)``), which all-reduces it itself.

Peak memory: each (TP, variant) runs one step in fresh processes (spawned; TP=2 is two gloo ranks),
so that one variant's freed memory cannot hide the other's peak; the peak is rank 0's ``ru_maxrss``
(the high-water mark of its resident memory, which the kernel keeps) minus its RSS just before the
step, the inputs and a 16-token warm-up step already in place. Time: then, per TP, one set of
processes runs ``--repeats`` steps of each variant interleaved (unfused, fused, unfused, ...) so
that both see the same load drift on a shared machine, and the fastest of each counts. Threads:
the machine's cores divided among the ranks. Prints both variants, the ratios fused / unfused and
the load average.

Usage (from the repository root):
    python -m bench.fused_logprob [--tokens 8192] [--vocab 151936] [--hidden 256] [--tp 1 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
import torch.multiprocessing as mp

from rltrain.ports import HeldPort


def _step(mode: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, args: tuple) -> None:
    import torch.distributed as dist

    from kernels.fused_logprob import fused_logprobs_entropy
    from rltrain.megatron.logprobs import vocab_parallel_logprobs_entropy

    group, rank, chunk_size, w_lp, w_ent = args
    hidden.grad = weight.grad = None
    if mode == "fused":
        lp, ent = fused_logprobs_entropy(
            hidden, weight, targets, tp_group=group, tp_rank=rank, chunk_size=chunk_size
        )
        (lp * w_lp + ent * w_ent).sum().backward()
    else:
        logits = hidden @ weight.t()
        lp, ent = vocab_parallel_logprobs_entropy(logits, targets, tp_group=group, tp_rank=rank)
        del logits
        (lp * w_lp + ent * w_ent).sum().backward()
        if group is not None:
            dist.all_reduce(hidden.grad, group=group)


def _rank(rank: int, world: int, port: int, modes: list[str], options: dict, queue: mp.Queue) -> None:
    """Runs ``repeats`` steps of each of ``modes`` (interleaved); reports rank 0's peak and times."""
    import psutil
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    group = None
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        group = dist.group.WORLD
    tokens, hidden_size, vocab = options["tokens"], options["hidden"], options["vocab"]
    gen = torch.Generator().manual_seed(rank)
    weight = (torch.randn(vocab // world, hidden_size, generator=gen) / hidden_size**0.5).requires_grad_()
    gen = torch.Generator().manual_seed(99)  # the same hidden states and targets on every rank
    hidden = torch.randn(tokens, hidden_size, generator=gen).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    w_lp, w_ent = torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen)
    step_args = (group, rank, options["chunk_size"], w_lp, w_ent)
    small = slice(0, 16)
    for mode in modes:  # warm-up on 16 tokens
        warm = hidden[small].detach().requires_grad_()
        _step(mode, warm, weight, targets[small], (*step_args[:3], w_lp[small], w_ent[small]))
    if group is not None:
        dist.barrier()
    before = psutil.Process().memory_info().rss
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(options["repeats"] if len(modes) > 1 else 1):
        for mode in modes:
            if group is not None:
                dist.barrier()
            start = time.perf_counter()
            _step(mode, hidden, weight, targets, step_args)
            seconds[mode].append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    queue.put((rank, peak, {mode: min(s) for mode, s in seconds.items()}))
    if group is not None:
        dist.destroy_process_group()


def _measure(modes: list[str], world: int, options: dict) -> tuple[float, dict[str, float]]:
    """(rank 0's peak bytes above its baseline, its fastest step seconds per mode), fresh processes."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with HeldPort("127.0.0.1") as port:
        procs = [
            ctx.Process(target=_rank, args=(r, world, port.port, modes, options, queue)) for r in range(world)
        ]
        for proc in procs:
            proc.start()
        results = {}
        for _ in procs:
            rank, peak, seconds = queue.get(timeout=3600)  # waits for: every rank's steps
            results[rank] = (peak, seconds)
        for proc in procs:
            proc.join(timeout=60)
    return results[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    options = {
        "tokens": args.tokens,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "chunk_size": args.chunk_size,
        "repeats": args.repeats,
    }
    print(
        f"bench/fused_logprob.py tokens={args.tokens} vocab={args.vocab} hidden={args.hidden} float32, "
        f"{os.cpu_count()} cores, load average before {os.getloadavg()}",
        flush=True,
    )
    for world in args.tp:
        from kernels.fused_logprob import CHUNK_ELEMENTS

        local = args.vocab // world
        chunk = args.chunk_size or max(1, CHUNK_ELEMENTS // local)
        logits_mib = args.tokens * local * 4 / 2**20
        print(
            f"TP={world}: rank 0's logits [{args.tokens}, {local}] float32 = {logits_mib:.0f} MiB; "
            f"fused chunks of at most {chunk} tokens ({chunk * local * 4 / 2**20:.0f} MiB of logits)",
            flush=True,
        )
        peaks = {mode: _measure([mode], world, options)[0] for mode in ("unfused", "fused")}
        _, seconds = _measure(["unfused", "fused"], world, options)
        for mode in ("unfused", "fused"):
            print(
                f"  {mode:>8}: peak above baseline {peaks[mode] / 2**20:8.0f} MiB "
                f"({peaks[mode] / 2**20 / logits_mib:.2f}× the logits), step {seconds[mode]:.2f} s",
                flush=True,
            )
        print(
            f"  fused / unfused: peak memory {peaks['fused'] / peaks['unfused']:.3f}, "
            f"time {seconds['fused'] / seconds['unfused']:.2f} (load average now {os.getloadavg()[0]:.2f})",
            flush=True,
        )
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
