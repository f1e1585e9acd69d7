"""Fan a step's metrics out to the console, TensorBoard, ``metrics.jsonl`` and W&B.

Contract: ``MetricsLogger(run_dir, backends=...).log(metrics, step=s)`` with a flat
``dict[str, float]`` (names in :mod:`rltrain.logging.metrics`) writes, for each backend selected
(:data:`DEFAULT_BACKENDS` unless told)

* ``run_dir/metrics.jsonl``: one object per call, ``{"step": s, <key>: <value>, ...}``, appended
  and flushed, non-finite values written as ``null`` (JSON has no NaN). A resumed run appends
  again; readers keep the last record of a step (:func:`rltrain.logging.plot.read_metrics`);
* ``run_dir/tensorboard/``: one scalar per key at global step ``s``, flushed every call;
* the console: one compact line of the main metrics, printed through ``tqdm.write`` so that it
  does not tear a progress bar;
* ``wandb``: a row of a Weights & Biases run in ``run_dir/wandb/`` (:mod:`rltrain.logging.wandb_run`;
  the optional package, imported only then).

A value that is not a real number fails naming its key.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from rltrain.logging import metrics as mk
from rltrain.logging.wandb_run import WandbBackend, WandbOptions

DEFAULT_BACKENDS = ("console", "tensorboard", "jsonl")
BACKENDS = (*DEFAULT_BACKENDS, "wandb")
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"

CONSOLE_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("reward", mk.REWARD_MEAN, "{:.3f}"),
    ("acc", mk.REWARD_ACCURACY, "{:.3f}"),
    ("kl", mk.ACTOR_KL, "{:.2e}"),
    ("β", mk.ACTOR_KL_COEF, "{:.2e}"),
    ("pg_loss", mk.ACTOR_PG_LOSS, "{:+.4f}"),
    ("vf_loss", mk.CRITIC_VF_LOSS, "{:.4f}"),
    ("entropy", mk.ACTOR_ENTROPY, "{:.3f}"),
    ("clipfrac", mk.ACTOR_PG_CLIPFRAC, "{:.3f}"),
    ("len", mk.RESPONSE_LENGTH_MEAN, "{:.1f}"),
    ("lp_diff", mk.ROLLOUT_LOGPROB_DIFF_MEAN, "{:.2e}"),
    ("tok/s", mk.PERF_TOKENS_PER_S, "{:.0f}"),
    ("step_s", mk.TIMING_STEP, "{:.2f}"),
)
"""(label, key, format) of the console line, in order; absent keys are skipped."""


def _as_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not hasattr(value, "__float__"):
        raise TypeError(f"metric {key!r} must be a real number, got {type(value).__name__}: {value!r}")
    return float(value)


def format_console_line(metrics: Mapping[str, float], *, step: int, total_steps: int | None) -> str:
    """``step 3/100 | reward 0.500 | acc 0.250 | ...`` with the keys of :data:`CONSOLE_FIELDS` present."""
    head = f"step {step}" if total_steps is None else f"step {step}/{total_steps}"
    parts = [head] + [
        f"{label} {fmt.format(metrics[key])}" for label, key, fmt in CONSOLE_FIELDS if key in metrics
    ]
    return " | ".join(parts)


class MetricsLogger:
    """Writes each step's metrics to the selected backends."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        backends: Sequence[str] = DEFAULT_BACKENDS,
        total_steps: int | None = None,
        console: TextIO | None = None,
        wandb: WandbOptions | None = None,
    ) -> None:
        """``wandb``: the W&B run's names and mode (with the ``wandb`` backend); None names the
        project and the run after ``run_dir``'s parent and ``run_dir`` (``project_name/experiment_name``),
        mode ``auto``."""
        unknown = sorted(set(backends) - set(BACKENDS))
        if unknown:
            raise ValueError(f"unknown metrics backends {unknown}; known: {list(BACKENDS)}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.console = console
        self.print_console = "console" in backends
        self.jsonl: TextIO | None = None
        if "jsonl" in backends:
            self.jsonl = (self.run_dir / METRICS_FILE).open("a", encoding="utf-8")
        self.writer = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR))
        self.wandb: WandbBackend | None = None
        if "wandb" in backends:
            options = wandb or WandbOptions(project=self.run_dir.parent.name, name=self.run_dir.name)
            self.wandb = WandbBackend(self.run_dir, options)

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        """Write ``metrics`` of global step ``step`` to every backend."""
        if "step" in metrics:
            raise ValueError("'step' is reserved in metrics; pass the step as log(..., step=...)")
        values = {key: _as_float(key, value) for key, value in metrics.items()}
        if self.jsonl is not None:
            record = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in values.items()}}
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, global_step=step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)
        if self.print_console and any(key in values for _, key, _ in CONSOLE_FIELDS):
            # a record with none of the line's fields (step 0's data counts) prints no bare "step 0/N"
            line = format_console_line(values, step=step, total_steps=self.total_steps)
            tqdm.write(line, file=self.console or sys.stdout)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
