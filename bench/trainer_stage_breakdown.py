"""Where the time of one PPO step goes: run a recipe for a few steps and tabulate its stage timings.

    python bench/trainer_stage_breakdown.py --recipe recipes/quickstart_cpu.yaml --steps 5
    python bench/trainer_stage_breakdown.py --recipe recipes/smollm2_135m_arith_cpu.yaml --steps 3 \\
        data.train_batch_size=4 actor.ppo_mini_batch_size=2

The recipe runs through the ``rltrain train`` CLI in a subprocess, into a temporary run directory,
with ``trainer.total_training_steps=--steps``, ``trainer.save_freq=0`` and ``trainer.test_freq=0``
(no checkpoints, no validation inside the timed steps) and ``RAY_ADDRESS=local`` (a Ray instance of
its own, unless RAY_ADDRESS is set); extra ``key=value`` arguments are passed on
as overrides. The run's ``metrics.jsonl`` is read back and, for every stage of
:data:`rltrain.logging.metrics.STAGES`, the mean seconds over the steps after the first (the first
step carries one-time costs: compilation of graphs, allocator growth, the critic-only warm-up step
of some recipes) are printed with their share of the mean ``timing_s/step``. "untimed" is the step
time not inside any stage (batching, metrics). The exact command is printed first.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def forced_overrides(overrides: list[str], *, steps: int, run_root: Path) -> list[str]:
    """``overrides`` plus what a timed run needs: ``steps`` steps under ``run_root``, no checkpoints,
    no validation, and every step training both the critic and the actor (no critic warm-up)."""
    return [
        *overrides,
        f"trainer.total_training_steps={steps}",
        "critic.warmup_steps=0",
        "trainer.save_freq=0",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        f"trainer.default_local_dir={run_root}",
    ]


def run_recipe(*, recipe: str, steps: int, overrides: list[str], run_root: Path) -> tuple[list[str], Path]:
    """Train ``recipe`` for ``steps`` steps under ``run_root``; returns the command and run directory."""
    from rltrain.config import load_config

    all_overrides = forced_overrides(overrides, steps=steps, run_root=run_root)
    run_dir = load_config(recipe, all_overrides).run_dir()
    command = [sys.executable, "-m", "rltrain.cli", "train", recipe, *all_overrides]
    print("command:", shlex.join(command), flush=True)
    start = time.perf_counter()
    # Without an address rltrain joins any Ray cluster already running on the machine (address
    # "auto"), e.g. another run's or a test's, which may remove our placement group when it stops.
    env = {**os.environ, "RAY_ADDRESS": os.environ.get("RAY_ADDRESS", "local")}
    print(f"RAY_ADDRESS={env['RAY_ADDRESS']}; load average before: {os.getloadavg()}", flush=True)
    subprocess.run(command, cwd=REPO_ROOT, check=True, env=env)
    print(f"load average after: {os.getloadavg()}", flush=True)
    print(f"run finished in {time.perf_counter() - start:.1f} s (process start to exit)", flush=True)
    return command, run_dir


def stage_table(records: list[dict], *, skip_first: int = 1) -> tuple[list[tuple[str, float, float]], int]:
    """Rows ``(stage, mean seconds, share of step)`` over the records after ``skip_first``."""
    from rltrain.logging import metrics as mk

    timed = [r for r in records if r.get(mk.TIMING_STEP) is not None]
    kept = timed[skip_first:]
    if not kept:
        raise ValueError(
            f"only {len(timed)} timed step(s) in the run; need more than {skip_first} (raise --steps)"
        )
    step_mean = statistics.fmean(r[mk.TIMING_STEP] for r in kept)
    rows = []
    for stage in mk.STAGES:
        key = mk.timing_key(stage)
        if any(key in r for r in kept):
            seconds = statistics.fmean(r.get(key, 0.0) for r in kept)
            rows.append((stage, seconds, seconds / step_mean))
    untimed = step_mean - sum(seconds for _, seconds, _ in rows)
    rows.append(("untimed", untimed, untimed / step_mean))
    rows.append(("step", step_mean, 1.0))
    return rows, len(kept)


def report_lines(*, command: list[str], run_dir: Path, records: list[dict]) -> list[str]:
    """The benchmark's result: the command, the sizes that shape a step, the stage table."""
    from rltrain.logging import metrics as mk

    rows, num_kept = stage_table(records)
    steps = ", ".join(f"{r[mk.TIMING_STEP]:.2f}" for r in records if mk.TIMING_STEP in r)
    lines = [f"command: {shlex.join(command)}", "sizes of the run (from its resolved config.yaml):"]
    lines += sizes_lines((run_dir / "config.yaml").read_text(encoding="utf-8"))
    lines += [
        f"timing_s/step per step: [{steps}]; table: mean over the last {num_kept} step(s)",
        f"{'stage':<14}{'mean s':>10}{'share':>9}",
    ]
    lines += [f"{stage:<14}{seconds:>10.3f}{share:>9.1%}" for stage, seconds, share in rows]
    last = records[-1]
    keys = (mk.PERF_NUM_TOKENS, mk.PERF_TOKENS_PER_S, mk.RESPONSE_LENGTH_MEAN, mk.REWARD_MEAN)
    lines += [f"last step {key}: {last[key]:.3f}" for key in keys if key in last]
    return lines


def sizes_lines(config_yaml: str) -> list[str]:
    import yaml

    config = yaml.safe_load(config_yaml)
    model = {k: v for k, v in config["model"].items() if v not in (None, {}) and k != "cache_dir"}
    picks = {
        "model": model,
        "data.train_batch_size": config["data"]["train_batch_size"],
        "data.max_prompt_length": config["data"]["max_prompt_length"],
        "rollout.n": config["rollout"]["n"],
        "rollout.response_length": config["rollout"]["response_length"],
        "actor.ppo_mini_batch_size": config["actor"]["ppo_mini_batch_size"],
        "actor.ppo_micro_batch_size_per_gpu": config["actor"]["ppo_micro_batch_size_per_gpu"],
        "actor.ppo_epochs": config["actor"]["ppo_epochs"],
        "critic.ppo_micro_batch_size_per_gpu": config["critic"]["ppo_micro_batch_size_per_gpu"],
        "critic.warmup_steps": config["critic"]["warmup_steps"],
    }
    return [f"  {key}: {json.dumps(value, default=str)}" for key, value in picks.items()]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="recipes/quickstart_cpu.yaml")
    parser.add_argument("--steps", type=int, default=5, help="training steps (the first is not averaged)")
    parser.add_argument("--run-root", help="keep the run here instead of a temporary directory")
    parser.add_argument("--out", help="also write the result (command, sizes, table) to this file")
    parser.add_argument(
        "overrides", nargs="*", help="extra dotted overrides, e.g. rollout.response_length=16"
    )
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is warm-up)")
    from rltrain.logging.plot import read_metrics

    with tempfile.TemporaryDirectory(prefix="bench_stages_") as tmp:
        run_root = Path(args.run_root) if args.run_root else Path(tmp)
        command, run_dir = run_recipe(
            recipe=args.recipe, steps=args.steps, overrides=args.overrides, run_root=run_root
        )
        text = "\n".join(report_lines(command=command, run_dir=run_dir, records=read_metrics(run_dir)))
    text += "\nload average (1, 5, 15 min) at the end: " + ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
