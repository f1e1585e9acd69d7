"""``rltrain plot RUN_DIR``: a PNG of a run's main curves, read from ``RUN_DIR/metrics.jsonl``.

Contract: :func:`plot_run` draws one panel per entry of :data:`PLOT_CURVES` (reward mean, KL to
the reference, response length, policy loss, entropy, rollout/trainer logprob gap, validation
accuracy, clip fraction) against the training step and writes ``RUN_DIR/metrics.png`` (or
``out_path``); the reward panel adds its mean over the last :data:`SMOOTHING_STEPS` steps once a run
has that many. A metric the run never logged gets an empty panel saying so. When a resumed run
logged a step twice, the last record wins.
Drawing uses matplotlib's object API on an Agg canvas, so no display and no global pyplot state.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from rltrain.logging import metrics as mk
from rltrain.logging.tracker import METRICS_FILE

PLOT_CURVES: tuple[tuple[str, str], ...] = (
    (mk.REWARD_MEAN, "reward mean"),
    (mk.ACTOR_KL, "KL(actor ‖ ref) per token"),
    (mk.RESPONSE_LENGTH_MEAN, "response length (tokens)"),
    (mk.ACTOR_PG_LOSS, "policy loss"),
    (mk.ACTOR_ENTROPY, "entropy"),
    (mk.ROLLOUT_LOGPROB_DIFF_MEAN, "|rollout − trainer| logprob"),
    (mk.VAL_ACCURACY, "validation accuracy"),
    (mk.ACTOR_PG_CLIPFRAC, "PPO clip fraction"),
)
"""(metric key, panel title) of the plotted curves."""

SMOOTHING_STEPS = 20
"""Window of the reward panel's running mean."""


def running_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (from the ``window``-th value on)."""
    return [sum(values[i - window + 1 : i + 1]) / window for i in range(window - 1, len(values))]


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` sorted by step, the last record of a repeated step kept."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path} (is {run_dir} a run directory?)")
    by_step: dict[int, dict[str, Any]] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {err}") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError(f"{path}:{lineno}: a record must be an object with an integer 'step'")
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def curve(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of ``key`` over ``records`` (steps without the key are skipped)."""
    points = [(r["step"], float(r[key])) for r in records if r.get(key) is not None]
    points = [(step, value) for step, value in points if math.isfinite(value)]
    return [s for s, _ in points], [v for _, v in points]


def plot_run(run_dir: str | Path, *, out_path: str | Path | None = None) -> Path:
    """Write a PNG of the main curves of ``run_dir`` and return its path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(run_dir)
    out = Path(out_path) if out_path is not None else Path(run_dir) / "metrics.png"
    fig = Figure(figsize=(16, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 4).ravel()
    for ax, (key, title) in zip(axes, PLOT_CURVES):
        steps, values = curve(records, key)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if steps:
            ax.plot(steps, values, marker="." if len(steps) < 50 else None, linewidth=1.2)
            ax.grid(alpha=0.3)
            if key == mk.REWARD_MEAN and len(values) >= SMOOTHING_STEPS:
                mean = running_mean(values, SMOOTHING_STEPS)
                ax.plot(
                    steps[SMOOTHING_STEPS - 1 :], mean, linewidth=2.2, label=f"{SMOOTHING_STEPS}-step mean"
                )
                ax.legend(fontsize=8, loc="lower right")
        else:
            ax.text(0.5, 0.5, f"{key}\nnot logged", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(str(Path(run_dir).resolve().name))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def add_plot_subparser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``plot RUN_DIR [--out PNG]`` to a CLI's subparsers; the parser's ``func`` is :func:`plot_main`."""
    parser = subparsers.add_parser("plot", help="write a PNG of a run's main curves from metrics.jsonl")
    parser.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: RUN_DIR/metrics.png)")
    parser.set_defaults(func=plot_main)
    return parser


def plot_main(args: argparse.Namespace) -> int:
    """Entry point of ``rltrain plot``: writes the PNG, prints its path, returns the exit code 0."""
    print(plot_run(args.run_dir, out_path=args.out))
    return 0
