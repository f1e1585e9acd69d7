"""What the default weight-sync verification costs: the colocated sync of a Megatron actor into an
in-process vLLM engine with ``rollout.weight_sync.verify_checksums`` off, sampled (the default) and
full, one run, on the quickstart's tiny llama and on a SmolLM2-135M-shaped model.

    python bench/weight_sync_verify.py [--repeats 16] [--models quickstart,smollm2]

Each model runs in a process of its own (one Megatron context per process): a random fp32 model is
saved, a one-rank Megatron-Core actor (TP=1, gloo) loads it (``rollout_weight_sync.megatron_actor``)
and one vLLM CPU engine (TP=1, in process) takes its weights through ``WeightSender.sync`` (the
trainer's whole sync: ``PlannedExport`` stream, ``ColocatedTransport``, the engine's direct load,
then the verification). Three senders share the engine; each does its sync 0 (sampled: every tensor
whole) as warm-up, then ``--repeats`` interleaved rounds (a multiple of ``verify_every`` = 8, so
the sampled rounds cover every rotation equally). Printed: the best time of each mode, the ratio
``sampled / off`` and ``full / off`` as the median over rounds of the paired times, the ratio of the
summed times, the verification's own seconds (``weight_sync/verify_seconds``: the engine's readback
and the comparison; the trainer's digests run inside the sync's stream) and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_weight_sync import SMOLLM2_135M

MODELS = {
    "quickstart": {},  # recipes/quickstart_cpu.yaml: the llama tiny preset, the tiny tokenizer's vocab
    "smollm2": SMOLLM2_135M,
}


def build_model_dir(root: Path, name: str) -> Path:
    """Save a random fp32 llama of ``MODELS[name]`` with the tiny tokenizer; returns the directory."""
    from transformers import AutoModelForCausalLM

    from rltrain.models.tiny import build_tiny_tokenizer, tiny_hf_config, tiny_vocab_size

    tokenizer = build_tiny_tokenizer()
    overrides = {"vocab_size": tiny_vocab_size(tokenizer), **MODELS[name]}
    config = tiny_hf_config("llama", **overrides)
    config.eos_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = root / name
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _top(stats, n: int) -> list[str]:
    """The ``n`` functions with the most cumulative time, one line each."""
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:n]
    return [
        f"{v[3] * 1e3:9.2f} ms cum {v[2] * 1e3:9.2f} ms own {v[1]:6d} calls  {k[2]} ({Path(k[0]).name}:{k[1]})"
        for k, v in rows
    ]


def run_model(name: str, repeats: int, profile: bool = False) -> None:
    """One model's rounds (this process: one Megatron context)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rollout_weight_sync import megatron_actor

    from megatron_bridge.reshard import EngineLayout
    from rltrain.config.rollout import WeightSyncConfig
    from rltrain.logging import metrics as m
    from rltrain.rollout.protocol import EngineSettings
    from rltrain.rollout.vllm.engine import VllmEngine
    from rltrain.rollout.vllm.options import VllmOptions
    from rltrain.weight_sync import ColocatedTransport
    from rltrain.weight_sync.sender import WeightSender

    root = Path(tempfile.mkdtemp(prefix="verify_bench_"))
    model_dir = build_model_dir(root, name)
    planned = megatron_actor(model_dir)
    engine = VllmEngine(
        str(model_dir),
        settings=EngineSettings(max_model_len=256, options=VllmOptions(kv_cache_space_gb=0.25)),
    )
    transport = ColocatedTransport(
        rank=0, host_ranks=[0], engine=engine, layout=EngineLayout(tp=1), bucket_bytes=1 << 30
    )
    default_every = WeightSyncConfig().verify_every
    variants = {"off": ("off", 1), f"sampled N={default_every}": ("sampled", default_every)}
    variants.update({f"sampled N={n}": ("sampled", n) for n in (8, 32) if n != default_every})
    variants["full"] = ("full", 1)
    modes = tuple(variants)
    senders = {
        label: WeightSender(
            planned,
            transport,
            rank=0,
            host_ranks=[0],
            engine=engine,
            engine_tp=1,
            verify=mode,
            verify_every=n,
        )
        for label, (mode, n) in variants.items()
    }
    for sender in senders.values():
        sender.sync()  # warm-up; sampled: its sync 0, every tensor whole
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    verify_s: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode, sender in senders.items():
            start = time.perf_counter()
            metrics = sender.sync()
            times[mode].append(time.perf_counter() - start)
            verify_s[mode].append(metrics.get(m.WEIGHT_SYNC_VERIFY_SECONDS, 0.0))
    num_params = sum(int(torch.Size(s).numel()) for s in planned.shapes.values())
    print(
        f"model {name}: {num_params / 1e6:.2f} M params, {len(planned.shapes)} HF tensors, {repeats} rounds"
    )
    for mode in modes:
        print(
            f"  {mode:12s} best {min(times[mode]) * 1e3:8.1f} ms  median {statistics.median(times[mode]) * 1e3:8.1f} ms"
            f"  verify_seconds mean {statistics.mean(verify_s[mode]) * 1e3:7.2f} ms"
        )
    for mode in modes[1:]:
        paired = statistics.median(a / b for a, b in zip(times[mode], times["off"]))
        summed = sum(times[mode]) / sum(times["off"])
        print(f"  {mode:12s} / off: {paired:.3f} (median of paired rounds), {summed:.3f} (summed)")
    print(f"  load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if profile:
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            for _ in range(8):
                senders[modes[1]].sync()
        for line in _top(pstats.Stats(prof), 80):
            if not any(
                part in line for part in ("checksum.py", "sender.py", "sampling.py", "worker_fns", "rpc")
            ):
                continue
            print("  " + line)
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's and gloo's teardown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=16)
    parser.add_argument("--models", default="quickstart,smollm2")
    parser.add_argument("--profile", action="store_true", help="profile 8 sampled syncs of each model")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one model in this process
    args = parser.parse_args()
    if args.one:
        run_model(args.one, args.repeats, args.profile)
        return
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} CPUs")
    for name in args.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"--models: unknown model {name!r}; known: {', '.join(MODELS)}")
        cmd = [sys.executable, __file__, "--one", name, "--repeats", str(args.repeats)]
        cmd += ["--profile"] if args.profile else []
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith(("model ", "  "))]
        print("\n".join(lines) if done.returncode == 0 else done.stdout[-2000:] + done.stderr[-3000:])


if __name__ == "__main__":
    main()
