"""CUDA IPC weight hand-off of a SmolLM2-135M-sized model between two processes on one GPU, against a
device-to-device copy of the same bytes, measured in the same run.

    python bench/weight_sync_gpu.py [--repeats 20] [--bucket-mb 512]

Tensors: the HF-named weights of a Llama with SmolLM2-135M's sizes (a ``LlamaConfig`` with hidden
576, 30 layers, 9 heads, 3 KV heads, intermediate 1536, vocabulary 49,152, tied embeddings: ~134.5 M
parameters, ~269 MB), random bf16 on the GPU; nothing is downloaded.

- ipc hand-off: ``VllmEngine.load_weights`` (``receive``) of an engine whose one TP worker runs
  in another process (``tests/gpu/ipc_engine.py``: vLLM's ``LLM`` replaced by a worker process that
  copies every tensor it receives into a preallocated tensor of its own, as a model's load does):
  the tensors packed into ``--bucket-mb`` buffers on the GPU, their CUDA IPC handles pickled to the
  worker, rebuilt there, copied into place, both sides synchronized. The colocated GPU path.
- d2d copy: the same bytes copied once on the device, one flat buffer into another: the floor of
  anything that moves the bytes once.
- d2d per tensor: every tensor copied into a preallocated tensor of its own (an in-process load at
  best).
The hand-off copies the bytes twice (pack, load), so twice the d2d copy is its floor; the rest is per
bucket: exporting and opening IPC handles, pickling, the round trip to the worker process.

Every variant runs ``--repeats`` interleaved rounds after one warm-up round; printed are the best
and median times, the bandwidth at the best, and each ratio as the median over rounds of the two
variants' times in the same round. Afterwards the worker's tensors are read back (SHA-256) and
compared with what was sent: exit code 1 on any difference, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "tests" / "gpu"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
)


def round_times(variants: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds per variant and round, after one warm-up call each; rounds interleaved."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--bucket-mb", type=int, default=None, help="default: rollout.weight_sync.bucket_size_mb"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("weight_sync_gpu: needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from ipc_engine import ProcessWorkers, ipc_engine, llama_tensors, region_digest
    from transformers import LlamaConfig

    from rltrain.config.rollout import WeightSyncConfig

    bucket_mb = args.bucket_mb or WeightSyncConfig().bucket_size_mb
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    cfg = LlamaConfig(**SMOLLM2_135M)
    named = list(
        llama_tensors(
            hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size,
            heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            layers=cfg.num_hidden_layers,
            vocab=cfg.vocab_size,
            tied=cfg.tie_word_embeddings,
            dtype=torch.bfloat16,
            device=device,
        )
    )
    num_bytes = sum(t.numel() * t.element_size() for _, t in named)
    print(
        f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}, CUDA {torch.version.cuda}\n"
        f"tensors: {len(named)} (SmolLM2-135M sizes, bf16), {sum(t.numel() for _, t in named) / 1e6:.1f} M "
        f"parameters, {num_bytes / 1e6:.1f} MB; buckets of {bucket_mb} MiB"
    )
    flat_src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)
    targets = {name: torch.empty_like(t) for name, t in named}
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in named}
    workers = ProcessWorkers(1, mode="copy", shapes=shapes)
    try:
        engine = ipc_engine(workers)

        def per_tensor() -> None:
            for name, tensor in named:
                targets[name].copy_(tensor)

        variants = {
            "d2d copy": lambda: flat_dst.copy_(flat_src),
            "d2d per tensor": per_tensor,
            "ipc hand-off": lambda: engine.load_weights(named, bucket_bytes=bucket_mb << 20),
        }
        times = round_times(variants, args.repeats)
        stats = engine.load_weights(named, bucket_bytes=bucket_mb << 20)
        sent = {name: region_digest(t) for name, t in named}
        (received,) = workers.collective_rpc("target_digests")
    finally:
        workers.close()
    for name, series in times.items():
        best = min(series)
        print(
            f"{name:<16} best {best * 1e3:8.3f} ms  median {statistics.median(series) * 1e3:8.3f} ms  "
            f"{num_bytes / best / 1e9:7.1f} GB/s"
        )
    print(f"ipc hand-off: {stats.num_buckets} bucket(s) a sync, path {stats.path}")
    for den in ("d2d copy", "d2d per tensor"):
        ratio = statistics.median(a / b for a, b in zip(times["ipc hand-off"], times[den]))
        print(f"ratio ipc hand-off / {den}: {ratio:.1f}x (median over {args.repeats} rounds)")
    wrong = sorted(name for name in sent if received.get(name) != sent[name])
    if wrong:
        print(f"NOT bit-exact: {len(wrong)} of {len(sent)} tensors differ in the worker: {wrong[:5]}")
        return 1
    print(f"bit-exact: all {len(sent)} tensors equal in the worker process")
    return 0


if __name__ == "__main__":
    sys.exit(main())
