"""Step time with the critic's calls overlapping the actor's (``trainer.overlap_critic``) against the
same recipe with them one after the other, interleaved run by run, on this machine.

    python bench/critic_overlap.py --steps 8 --rounds 2
    python bench/critic_overlap.py --recipe recipes/smollm2_135m_arith_cpu.yaml --steps 3 --rounds 1 \\
        data.train_batch_size=4 rollout.n=4

Each round runs the recipe through ``rltrain train`` (``trainer_stage_breakdown.run_recipe``: a
Ray instance of its own, no checkpoints or validation in the timed steps) with
``trainer.overlap_critic=false``, then ``=true``, at the same seed. Before each run the script
waits (up to ``--settle-s``) for the 1-minute load average to fall to the core count and records
it; when it stayed above before any run, no ratio is reported. A variant's step time is the median
``timing_s/step`` over every step of its runs but each run's first. Printed: every run's step
times, the two medians, their ratio (overlapped / sequential), the per-stage means of each variant
(with overlap, ``values`` and ``update_critic`` count only what the step still waited for), and
whether both variants' metrics are equal in every key but timings (they must be: the roles are
separate processes either way).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from trainer_stage_breakdown import run_recipe  # bench/ is the script's folder: on sys.path
from trainer_vs_trl import settled_load

VARIANTS = {"sequential": "trainer.overlap_critic=false", "overlapped": "trainer.overlap_critic=true"}
NONDETERMINISTIC = ("timing_s/", "perf/", "weight_sync/seconds")


def differing_keys(runs: list[list[dict]]) -> list[str]:
    """``step:key`` of every metric (timings aside) on which the runs of ``runs`` disagree."""
    first, out = runs[0], []
    for other in runs[1:]:
        for a, b in zip(first, other, strict=True):
            for key in sorted(set(a) | set(b)):
                if not key.startswith(NONDETERMINISTIC) and a.get(key) != b.get(key):
                    out.append(f"{a.get('step')}:{key}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="recipes/quickstart_cpu.yaml")
    parser.add_argument("--steps", type=int, default=8, help="steps a run (its first is not counted)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (sequential, overlapped) runs")
    parser.add_argument("--settle-s", type=float, default=90.0, help="wait up to this long for the load")
    parser.add_argument("--out", help="also write the result to this file")
    parser.add_argument("overrides", nargs="*", help="overrides of the recipe")
    args = parser.parse_args()
    if args.steps < 2 or args.rounds < 1:
        parser.error("--steps must be at least 2 and --rounds at least 1")
    from rltrain.logging import metrics as mk
    from rltrain.logging.plot import read_metrics

    cores = os.cpu_count() or 1
    step_times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    records: dict[str, list[list[dict]]] = {name: [] for name in VARIANTS}
    lines, loads = [f"recipe: {args.recipe} {' '.join(args.overrides)}"], []
    with tempfile.TemporaryDirectory(prefix="bench_overlap_") as tmp:
        for round_ in range(args.rounds):
            for name, switch in VARIANTS.items():
                load = settled_load(cores=cores, settle_s=args.settle_s)
                loads.append(load)
                root = Path(tmp) / f"{name}{round_}"
                _, run_dir = run_recipe(
                    recipe=args.recipe, steps=args.steps, overrides=[*args.overrides, switch], run_root=root
                )
                run = [r for r in read_metrics(run_dir) if mk.TIMING_STEP in r]
                records[name].append(run)
                per_step = [r[mk.TIMING_STEP] for r in run[1:]]
                step_times[name] += per_step
                times = ", ".join(f"{s:.3f}" for s in per_step)
                lines.append(f"round {round_ + 1}, {name}: s/step [{times}] (1-min load before {load:.1f})")
    medians = {name: statistics.median(times) for name, times in step_times.items()}
    lines.append(f"{'variant':<12}{'median s/step':>15}{'steps':>7}")
    lines += [f"{name:<12}{medians[name]:>15.3f}{len(step_times[name]):>7}" for name in VARIANTS]
    busy = [load for load in loads if load > cores]
    if busy:
        lines.append(
            f"no ratio reported: the load average exceeded the {cores} cores before {len(busy)} run(s)"
        )
    else:
        ratio = medians["overlapped"] / medians["sequential"]
        lines.append(f"overlapped / sequential: {ratio:.2f}x")
    lines.append("stage means (s), steps after each run's first:")
    for stage in (*mk.STAGES, "step"):
        key = mk.timing_key(stage)
        means = [
            statistics.fmean(r.get(key, 0.0) for run in records[name] for r in run[1:]) for name in VARIANTS
        ]
        if any(means):
            lines.append(f"  {stage:<14}" + "".join(f"{m:>10.3f}" for m in means))
    differ = differing_keys([run for name in VARIANTS for run in records[name]])
    lines.append(
        "metrics of every run equal in every key but timings"
        if not differ
        else f"metrics DIFFER between runs: {', '.join(differ[:10])}"
    )
    lines.append(
        f"1-min load before the runs: min {min(loads):.1f}, max {max(loads):.1f}; (1, 5, 15 min) at the end: "
        + ", ".join(f"{x:.1f}" for x in os.getloadavg())
    )
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
