"""Step time of ``trainer.pipeline`` sync, one_step_off and fully_async side by side, in one run.

    python bench/pipeline_modes.py --steps 12
    python bench/pipeline_modes.py --steps 12 --reward-latency-ms 4 --max-staleness 2
    python bench/pipeline_modes.py --steps 10 --sft-warmup-steps 0 --response-length 96 \
        reward.launch_reward_fn_async=true

The workload: the quickstart recipe with its engines on their own device (``rollout.mode:
separate``), a long-tail response length distribution (the tiny model is warmed up on the task for
only ``--sft-warmup-steps`` steps, so most answers end after a few tokens and some run to
``--response-length``), and a reward with latency (the arithmetic reward plus ``--reward-latency-ms``
of waiting per response, in the driver). The trainer's roles and the driver run on the first CPU,
the engine on the second (``RLTRAIN_ROLE_CPUS``; ``--no-pin`` leaves placement to Ray and the OS).

Each mode runs ``--steps`` steps in-process (a local Ray of its own each) at the same seed; the steps
after the first ``--skip`` (start-up, the pipeline filling) are summarised by their median
``timing_s/step`` and samples per second. From the sync run, g = median ``timing_s/generate`` and t
= the rest of its step: the ideal overlapped step is max(g, t), the ideal ratio max(g, t)/(g + t),
printed next to each mode's measured ratio to sync. The load average is printed before and after
(the ratio means little when the machine is busy). The issue's goal: fully_async at most 0.6× sync.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = REPO_ROOT / "recipes" / "quickstart_cpu.yaml"
SLOW_SOURCE = "arithmetic_with_latency"


def register_slow_reward(latency_s: float) -> None:
    """The arithmetic reward, after ``latency_s`` of waiting (a remote judge's round trip)."""
    from rltrain.rewards.math_answers import arithmetic_reward, integer_ground_truth_problem
    from rltrain.rewards.registry import register_reward

    @register_reward(SLOW_SOURCE, ground_truth=integer_ground_truth_problem)
    def arithmetic_with_latency(response, ground_truth, *, correct_score=1.0, format_score=0.0, **kw):
        time.sleep(latency_s)
        return arithmetic_reward(
            response, ground_truth, correct_score=correct_score, format_score=format_score, **kw
        )


def run_mode(name: str, extra: list[str], *, args, root: Path) -> list[dict]:
    from rltrain.config import load_config
    from rltrain.logging.plot import read_metrics
    from rltrain.orchestrator.entry import train

    overrides = [
        f"trainer.default_local_dir={root / name}",
        f"model.cache_dir={root / 'cache'}",
        f"model.tiny.sft_warmup_steps={args.sft_warmup_steps}",
        f"rollout.response_length={args.response_length}",
        "rollout.mode=separate",
        "rollout.num_devices=1",
        f"trainer.total_training_steps={args.steps}",
        "critic.warmup_steps=0",
        "trainer.save_freq=0",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        f"reward.source_overrides={{arithmetic: {SLOW_SOURCE}}}",
        *extra,
        *args.overrides,
    ]
    config = load_config(RECIPE, overrides)
    print(
        f"--- {name}: {' '.join(extra) or 'trainer.pipeline=sync'}; load before {os.getloadavg()}", flush=True
    )
    train(config)
    return [r for r in read_metrics(config.run_dir()) if r["step"] >= 1]


def summarise(records: list[dict], *, skip: int, samples_per_step: int) -> dict[str, float]:
    kept = records[skip:]
    step = statistics.median(r["timing_s/step"] for r in kept)
    generate = statistics.median(r["timing_s/generate"] for r in kept)
    lengths = [r["response/length/mean"] for r in kept]
    return {
        "step_s": step,
        "generate_s": generate,
        "samples_per_s": samples_per_step / step,
        "response_len_mean": statistics.mean(lengths),
        "response_len_max": max(r["response/length/max"] for r in kept),
        "staleness_max": max(r.get("async/staleness_max", 0.0) for r in kept),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="steps left out of the medians")
    parser.add_argument("--max-staleness", type=int, default=2, help="fully_async's bound")
    parser.add_argument("--reward-latency-ms", type=float, default=4.0, help="per response")
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--sft-warmup-steps", type=int, default=10)
    parser.add_argument("--no-pin", action="store_true", help="do not pin trainer and engine to CPUs")
    parser.add_argument("overrides", nargs="*", help="more key=value overrides for every mode")
    args = parser.parse_args()

    os.environ.setdefault("RAY_ADDRESS", "local")
    cpus = sorted(os.sched_getaffinity(0))
    if not args.no_pin:
        if len(cpus) < 2:
            sys.exit("pinning needs two CPUs (or pass --no-pin)")
        trainer_cpu, engine_cpu = cpus[0], cpus[1]
        os.environ["RLTRAIN_ROLE_CPUS"] = (
            f"actor_rollout_ref={trainer_cpu};critic={trainer_cpu};rollout={engine_cpu}"
        )
        os.sched_setaffinity(0, {trainer_cpu})  # the driver (rewards, batching) with the trainer
        print(f"pinned: trainer roles and driver on CPU {trainer_cpu}, engine on CPU {engine_cpu}")
    register_slow_reward(args.reward_latency_ms / 1000)

    from rltrain.config import load_config

    base = load_config(RECIPE, args.overrides)
    samples = base.data.train_batch_size * base.rollout.n
    modes = [
        ("sync", []),
        ("one_step_off", ["trainer.pipeline=one_step_off"]),
        ("fully_async", ["trainer.pipeline=fully_async", f"trainer.max_staleness={args.max_staleness}"]),
    ]
    load_before = os.getloadavg()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="rltrain-pipeline-bench-") as tmp:
        for name, extra in modes:
            records = run_mode(name, extra, args=args, root=Path(tmp))
            rows[name] = summarise(records, skip=args.skip, samples_per_step=samples)
    sync = rows["sync"]
    g = sync["generate_s"]
    t = sync["step_s"] - g
    ideal = max(g, t) / (g + t)
    print()
    print(
        f"workload: {samples} samples per step, response length cap {args.response_length}, "
        f"reward latency {args.reward_latency_ms:g} ms per response, {args.steps} steps "
        f"(medians over steps {args.skip + 1}..{args.steps})"
    )
    print(
        f"sync split: generate g = {g:.3f} s, the rest of the step t = {t:.3f} s; "
        f"ideal overlapped step max(g, t) = {max(g, t):.3f} s, ideal ratio {ideal:.2f}"
    )
    print(
        f"{'mode':<13} {'step s':>8} {'samples/s':>10} {'× sync':>7} {'ideal ×':>8} "
        f"{'resp len mean/max':>18} {'staleness max':>14}"
    )
    for name, row in rows.items():
        ratio = row["step_s"] / sync["step_s"]
        want = 1.0 if name == "sync" else ideal
        print(
            f"{name:<13} {row['step_s']:8.3f} {row['samples_per_s']:10.1f} {ratio:7.2f} {want:8.2f} "
            f"{row['response_len_mean']:9.1f}/{row['response_len_max']:<8.0f} {row['staleness_max']:14.0f}"
        )
    print(f"load average: before {load_before}, after {os.getloadavg()} ({len(cpus)} CPUs)")
    print(json.dumps({"ideal_ratio": ideal, **{k: v for k, v in rows.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
