"""Benchmark: actor forward+backward tokens/s at TP=1 vs TP=2 on CPU (gloo).

A small Llama-shaped actor (hidden 256, 4 layers, 8 heads / 4 KV groups, vocab 8192) runs Megatron's
forward-backward schedule over packed micro-batches with a policy-gradient loss (vocab-parallel
logprobs + entropy), as ``MegatronWorker.update`` does, without the optimizer step. TP=1 is one process with
one thread; TP=2 is two processes with one thread each. Prints tokens/s of each and TP=2 / TP=1.

Usage (from the repository root): python -m bench.megatron_tp_throughput [--iters 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, tp: int, iters: int, queue: mp.Queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from transformers import LlamaConfig

    from rltrain.algo.token_batch import ModelOutput, TokenBatch
    from rltrain.config.optim import OptimConfig
    from rltrain.config.parallel import ParallelConfig
    from rltrain.megatron.forward import run_model
    from rltrain.megatron.micro_batches import MicroBatching
    from rltrain.megatron.parallel import ParallelContext
    from rltrain.megatron.worker import MegatronWorker

    hf = LlamaConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
    )  # fmt: skip
    ctx = ParallelContext.initialize(ParallelConfig(tensor_model_parallel_size=tp), seed=1)
    worker = MegatronWorker(
        hf, ctx=ctx, role="actor", optim=OptimConfig(), batching=MicroBatching(micro_batch_size=4)
    )
    gen = torch.Generator().manual_seed(0)
    batch = TokenBatch(
        input_ids=torch.randint(0, 8192, (8, 256), generator=gen),
        attention_mask=torch.ones(8, 256, dtype=torch.long),
        response_len=128,
    )
    tokens = batch.input_ids.numel()

    def loss_fn(out: ModelOutput, mb: TokenBatch) -> tuple[torch.Tensor, dict]:
        return -(out.logprobs.sum() + 0.01 * out.entropy.sum()) / (tokens / 2), {}

    timings = []
    for step in range(iters + 2):
        for chunk in worker.model:
            chunk.zero_grad_buffer()
        start = time.perf_counter()
        run_model(worker.model, batch, ctx=ctx, batching=worker.batching, loss_fn=loss_fn)
        if step >= 2:  # two warm-up iterations
            timings.append(time.perf_counter() - start)
    ctx.destroy()
    queue.put((rank, tokens * len(timings) / sum(timings)))


def _tokens_per_second(tp: int, iters: int) -> float:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, tp, port, tp, iters, queue)) for r in range(tp)]
    for proc in procs:
        proc.start()
    rates = [queue.get(timeout=900)[1] for _ in procs]
    for proc in procs:
        proc.join()
    return min(rates)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    tp1 = _tokens_per_second(1, args.iters)
    print(f"TP=1 (1 process × 1 thread):  {tp1:8.0f} tokens/s forward+backward")
    tp2 = _tokens_per_second(2, args.iters)
    print(f"TP=2 (2 processes × 1 thread): {tp2:8.0f} tokens/s forward+backward")
    print(f"TP=2 / TP=1 throughput: {tp2 / tp1:.2f}  (machine load: {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
