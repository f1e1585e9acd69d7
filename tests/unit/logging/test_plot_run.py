"""``rltrain plot``: metrics.jsonl reading (resumed runs), curves and the PNG."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from rltrain.logging.plot import PLOT_CURVES, add_plot_subparser, curve, plot_run, read_metrics


def write_run(run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    records = [
        {"step": 1, "reward/score/mean": 0.1, "actor/kl": 0.0},
        {"step": 2, "reward/score/mean": 0.2, "actor/kl": None},
        {"step": 3, "reward/score/mean": 9.9},  # superseded: the run resumed from step 2
        {"step": 3, "reward/score/mean": 0.3, "actor/kl": 0.02, "response/length/mean": 40.0},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_read_metrics_keeps_last_record_per_step_and_curves_skip_gaps(tmp_path: Path) -> None:
    write_run(tmp_path)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert curve(records, "reward/score/mean") == ([1, 2, 3], [0.1, 0.2, 0.3])
    assert curve(records, "actor/kl") == ([1, 3], [0.0, 0.02])
    assert curve(records, "actor/entropy") == ([], [])


def test_plot_run_writes_png_of_expected_size(tmp_path: Path) -> None:
    from matplotlib.image import imread

    write_run(tmp_path)
    out = plot_run(tmp_path)
    assert out == tmp_path / "metrics.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(out).shape == (650, 1600, 4)  # figsize (16, 6.5) inches at 100 dpi
    assert [key for key, _ in PLOT_CURVES] == [
        "reward/score/mean",
        "actor/kl",
        "response/length/mean",
        "actor/pg_loss",
        "actor/entropy",
        "rollout/logprob_abs_diff_mean",
        "val/accuracy",
        "actor/pg_clipfrac",
    ]


def test_running_mean_averages_the_window_ending_at_each_step() -> None:
    from rltrain.logging.plot import running_mean

    assert running_mean([1.0, 2.0, 3.0, 4.0, 8.0], 3) == [2.0, 3.0, 5.0]
    assert running_mean([1.0, 2.0], 3) == []


def test_plot_subcommand(tmp_path: Path, capsys) -> None:
    write_run(tmp_path / "run")
    parser = argparse.ArgumentParser(prog="rltrain")
    add_plot_subparser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "curves.png")])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no metrics file at .*metrics\.jsonl"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": "two"}\n')
    with pytest.raises(
        ValueError, match=r"metrics\.jsonl:2: a record must be an object with an integer 'step'"
    ):
        read_metrics(tmp_path)
