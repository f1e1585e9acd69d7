"""Where a training step's time goes, process by process: py-spy samples of a live ``rltrain train`` run.

    pip install py-spy==0.4.1    # benchmark-only dependency
    python bench/step_efficiency.py --recipe recipes/quickstart_cpu.yaml --profile 20

``profile_recipe`` starts the recipe like ``trainer_stage_breakdown.run_recipe`` (its own Ray
instance, no checkpoints or validation), waits until ``skip_steps`` steps are in ``metrics.jsonl``
(start-up and the first steps are not profiled), then samples every Python process of the run (the
driver and each Ray worker, found as descendants of the ``rltrain train`` process) with
``py-spy record --nonblocking`` at ``rate`` Hz for ``duration`` seconds. py-spy records a sample
only while a thread is active, so each process's samples divided by the rate are its CPU-active
seconds; the rest of the window it waited (on Ray, on another role, on a lock).

Each sample is put in the first category its stack matches, in this order: the vLLM engine
(generation), the optimizer step, autograd's backward, the model's forward (Megatron's
transformer/model/tensor-parallel modules, transformers' models, rltrain's packed attention),
rltrain's own code (by the innermost rltrain file and function: batch building, log-probs from the
logits, losses, advantages, weight sync, ...), Megatron's schedule and DDP bookkeeping, Ray's
(de)serialization, the rest of Ray (by its innermost function), then torch or the innermost file. The report gives, per process, active seconds, the share of the
window and the top categories.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("vLLM engine (generation)", ("vllm/",)),
    ("optimizer step", ("torch/optim/", "megatron/core/optimizer/")),
    ("backward (autograd)", ("torch/autograd/",)),
    (
        "model forward",
        (
            "megatron/core/transformer/",
            "megatron/core/models/",
            "megatron/core/tensor_parallel/layers",
            "transformers/models/",
            "rltrain/megatron/packed_attention",
        ),
    ),
]
"""Category → path prefixes (as py-spy prints them: relative to ``site-packages`` or the repository);
a sample is in the first category any frame of its stack matches."""


def frame_file(frame: str) -> str:
    """The file of a py-spy frame ``func (path:line)``, relative to ``site-packages`` when under it."""
    path = frame.rpartition(" (")[2].rstrip(")").rsplit(":", 1)[0]
    return path.split("site-packages/", 1)[-1].lstrip("/")


def classify(frames: list[str]) -> str:
    """The category of one sampled stack (``frames`` outermost first, py-spy's ``func (file:line)``)."""
    files = [frame_file(frame) for frame in frames]
    for name, prefixes in CATEGORIES:
        if any(path.startswith(prefixes) for path in files):
            return name
    for frame, path in zip(reversed(frames), reversed(files), strict=True):
        if path.startswith("rltrain/"):
            return f"{path}:{frame.partition(' (')[0]}"
    if any(path.startswith("megatron/core/") for path in files):
        return "Megatron schedule/DDP bookkeeping"
    ray = [(frame, path) for frame, path in zip(frames, files, strict=True) if path.startswith("ray/")]
    if ray:
        if any(key in path for path in files for key in ("serializ", "pickle")):
            return "Ray (de)serialization"
        frame, path = ray[-1]
        return f"Ray runtime ({path.rsplit('/', 1)[-1]}:{frame.partition(' (')[0]})"
    if files and files[-1].startswith("torch/"):
        return "torch (other)"
    return f"other: {files[-1] if files else '?'}"


def read_raw(path: Path) -> Counter[str]:
    """Samples per category of a py-spy ``--format raw`` file (``frame;frame;... count`` lines)."""
    counts: Counter[str] = Counter()
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            counts[classify(stack.split(";"))] += int(count)
    return counts


def descendants(root: int) -> list[int]:
    """Process ids under ``root`` (itself included), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def process_name(pid: int) -> str:
    try:
        argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [w.decode(errors="replace") for w in argv if w]
    return " ".join(words[:3])[:60] if words else "?"


def python_processes(root: int) -> dict[int, str]:
    """The run's Python processes: the driver and Ray's workers (``ray::...``), not Ray's daemons."""
    found = {}
    for pid in descendants(root):
        name = process_name(pid)
        daemon = name.startswith(("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent"))
        if pid == root or (name.startswith("ray::") and not daemon):
            found[pid] = name
    return found


def profile_recipe(
    *,
    recipe: str,
    steps: int,
    overrides: list[str],
    run_root: Path,
    skip_steps: int,
    duration: float,
    rate: int = 100,
) -> tuple[Path, list[str]]:
    """Run the recipe, profile ``duration`` seconds after step ``skip_steps``; returns the run dir and report."""
    from trainer_stage_breakdown import forced_overrides

    from rltrain.config import load_config

    all_overrides = forced_overrides(overrides, steps=steps, run_root=run_root)
    run_dir = load_config(recipe, all_overrides).run_dir()
    command = [sys.executable, "-m", "rltrain.cli", "train", recipe, *all_overrides]
    print("command:", shlex.join(command), flush=True)
    env = {**os.environ, "RAY_ADDRESS": os.environ.get("RAY_ADDRESS", "local")}
    run = subprocess.Popen(command, cwd=REPO_ROOT, env=env)
    metrics = run_dir / "metrics.jsonl"
    while run.poll() is None and _steps_logged(metrics) < skip_steps:
        time.sleep(0.5)
    if run.poll() is not None:
        raise RuntimeError(f"the run ended (exit {run.returncode}) before step {skip_steps}: raise --steps")
    targets = python_processes(run.pid)
    first_step = _steps_logged(metrics) + 1
    out_dir = run_root / "profiles"
    out_dir.mkdir(parents=True, exist_ok=True)
    spies = {
        pid: subprocess.Popen(
            [
                _py_spy(),
                "record",
                "--pid",
                str(pid),
                "--duration",
                str(int(duration)),
                "--rate",
                str(rate),
                "--format",
                "raw",
                "--nonblocking",
                "--output",
                str(out_dir / f"{pid}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for pid in targets
    }
    for spy in spies.values():
        spy.wait(timeout=duration + 60)
    last_step = _steps_logged(metrics)
    if run.wait(timeout=3600) != 0:
        raise RuntimeError(f"the profiled run failed (exit {run.returncode})")
    lines = [
        f"profile: py-spy at {rate} Hz for {duration:.0f} s, during steps {first_step}-{last_step}; "
        "active s = CPU-active samples / rate (the rest of the window the process waited)",
        f"{'process':<44}{'active s':>9}{'window':>8}  top categories (share of the process's samples)",
    ]
    for pid, name in targets.items():
        path = out_dir / f"{pid}.txt"
        counts = read_raw(path) if path.exists() else Counter()
        total = sum(counts.values())
        top = (
            ", ".join(f"{cat} {n / total:.0%}" for cat, n in counts.most_common(5))
            if total
            else "(no samples)"
        )
        label = "driver (rltrain train)" if pid == run.pid else name
        lines.append(f"{label:<44}{total / rate:>9.1f}{total / rate / duration:>8.0%}  {top}")
    return run_dir, lines


def _py_spy() -> str:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else "py-spy"


def _steps_logged(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return sum('"timing_s/step"' in line for line in metrics.read_text(encoding="utf-8").splitlines())
