"""The metrics logger's three backends (JSONL, TensorBoard read back, console) and the progress bar."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch

from rltrain.logging.progress import StepProgress
from rltrain.logging.tracker import MetricsLogger, format_console_line

STEPS = {
    1: {"reward/score/mean": 0.25, "actor/pg_loss": -0.5, "timing_s/generate": 1.5},
    2: {
        "reward/score/mean": 0.75,
        "actor/pg_loss": 0.125,
        "timing_s/generate": 2.0,
        "actor/kl": float("nan"),
    },
}


def test_jsonl_tensorboard_and_console(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    console = io.StringIO()
    with MetricsLogger(tmp_path / "run", total_steps=2, console=console) as logger:
        for step, metrics in STEPS.items():
            logger.log({**metrics, "actor/lr": torch.tensor(1e-6)}, step=step)

    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {
            "step": 1,
            "reward/score/mean": 0.25,
            "actor/pg_loss": -0.5,
            "timing_s/generate": 1.5,
            "actor/lr": pytest.approx(1e-6),
        },
        {
            "step": 2,
            "reward/score/mean": 0.75,
            "actor/pg_loss": 0.125,
            "timing_s/generate": 2.0,
            "actor/kl": None,
            "actor/lr": pytest.approx(1e-6),
        },
    ]

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    for key in ("reward/score/mean", "actor/pg_loss", "timing_s/generate"):
        scalars = events.Scalars(key)
        assert [(s.step, s.value) for s in scalars] == [(step, STEPS[step][key]) for step in (1, 2)]
    (kl,) = events.Scalars("actor/kl")
    assert kl.step == 2 and math.isnan(kl.value)

    assert console.getvalue().splitlines() == [
        "step 1/2 | reward 0.250 | pg_loss -0.5000",
        "step 2/2 | reward 0.750 | kl nan | pg_loss +0.1250",
    ]


def test_console_line_field_formats() -> None:
    line = format_console_line(
        {
            "reward/score/mean": 0.5,
            "reward/accuracy": 0.25,
            "actor/kl": 0.00123,
            "actor/kl_coef": 0.001,
            "actor/entropy": 1.5,
            "response/length/mean": 42.25,
            "rollout/logprob_abs_diff_mean": 0.0005,
            "perf/tokens_per_s": 1234.4,
            "timing_s/step": 3.214,
            "critic/score/other": 9.0,  # not a console field
        },
        step=7,
        total_steps=None,
    )
    assert line == (
        "step 7 | reward 0.500 | acc 0.250 | kl 1.23e-03 | β 1.00e-03 | entropy 1.500 | len 42.2 "
        "| lp_diff 5.00e-04 | tok/s 1234 | step_s 3.21"
    )


def test_bad_values_and_backends(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, backends=("jsonl",)) as logger:
        with pytest.raises(TypeError, match="metric 'actor/pg_loss' must be a real number, got str"):
            logger.log({"actor/pg_loss": "high"}, step=0)
        with pytest.raises(ValueError, match="'step' is reserved"):
            logger.log({"step": 1.0}, step=0)
        logger.log({"actor/pg_loss": 1.0}, step=3)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 3, "actor/pg_loss": 1.0}\n'
    assert not (tmp_path / "tensorboard").exists()
    with pytest.raises(ValueError, match=r"unknown metrics backends \['mlflow'\]"):
        MetricsLogger(tmp_path, backends=("jsonl", "mlflow"))


def test_progress_bar_counts_steps_with_eta_and_reward() -> None:
    out = io.StringIO()
    with StepProgress(5, initial_step=1, file=out) as progress:
        progress.update({"reward/score/mean": 0.5, "reward/accuracy": 0.25})
        progress.update()
        assert progress.step == 3
    text = out.getvalue()
    assert "1/5" in text and "3/5" in text
    assert "<" in text.split("3/5")[-1]  # tqdm's [elapsed<remaining] ETA
    assert "reward=0.500" in text and "acc=0.250" in text
    with pytest.raises(ValueError, match=r"initial_step must lie in \[0, total_steps=5\], got 6"):
        StepProgress(5, initial_step=6, disable=True)


def test_progress_bar_rewinds_to_the_step_a_recovered_run_resumes_from() -> None:
    out = io.StringIO()
    with StepProgress(5, file=out) as progress:
        for _ in range(4):
            progress.update()
        progress.rewind(2)
        assert progress.step == 2
        progress.update()
        assert progress.step == 3
    assert "3/5" in out.getvalue().split("\r")[-1]  # the bar shows the count from the rewound step
