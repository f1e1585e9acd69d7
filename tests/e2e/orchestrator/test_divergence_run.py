"""A run whose learning rate blows the weights up stops with one line and exit code 1, at the step
that diverged, before that step's checkpoint: ``latest`` stays on the last good one.

The quickstart recipe at ``actor.optim.lr=1e9`` with two warm-up steps: the first optimizer step runs
at lr 0 (Megatron's linear warm-up starts at 0) and is saved as ``step_1``; the second, at lr 5e8,
moves every parameter by about the learning rate (Adam's first steps move each element by ~lr), far
past ``trainer.max_param_abs`` (1e4), while the weights are still finite.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rltrain.config import load_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "quickstart_cpu.yaml"


def test_a_blown_up_learning_rate_stops_the_run_before_its_checkpoint(ray_env, tmp_path):
    overrides = [
        f"trainer.default_local_dir={tmp_path / 'runs'}",
        f"model.cache_dir={tmp_path / 'models'}",
        "trainer.total_training_steps=3",
        "critic.warmup_steps=0",
        "actor.ppo_mini_batch_size=16",  # one optimizer step a PPO step, as the docstring counts them
        "trainer.save_freq=1",
        "trainer.test_freq=0",
        "trainer.logger=[jsonl]",
        "actor.optim.lr=1e9",
        "actor.optim.lr_warmup_steps=2",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "rltrain.cli", "train", str(RECIPE), *overrides],
        env=ray_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    printed = run.stdout + run.stderr
    assert run.returncode == 1, printed[-6000:]
    last = run.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"rltrain train: actor diverged: a parameter reached magnitude 5\.\d{3}e\+08 after an optimizer step "
        r"\(lr 5e\+08\), above trainer\.max_param_abs=10000",
        last,
    ), printed[-6000:]
    assert "Traceback" not in printed
    checkpoints = load_config(RECIPE, overrides).run_dir() / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_1"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_1"]
