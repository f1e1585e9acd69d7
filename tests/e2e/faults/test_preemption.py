"""Preemption for real: ``rltrain train`` (its own private Ray, whose SIGTERM handler it replaces)
gets SIGTERM after its first step, and SIGUSR1 a moment later (a second signal during the step or its
save); it saves the step although ``trainer.save_freq=0`` never would, exits 75 with one line naming
the checkpoint and the command to resume with, and that command continues to the metrics of the
uninterrupted run."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
from fault_runs import RECIPE, ROOT, STEPS, assert_same_metrics, fault_overrides, metrics_of, wait_for

from rltrain.config import load_config
from rltrain.orchestrator.preemption import PREEMPTED_EXIT_CODE

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_sigterm_saves_exits_75_and_the_printed_command_resumes(fault_ray, fault_cache, reference, tmp_path):
    overrides = fault_overrides(tmp_path, fault_cache, "trainer.save_freq=0")
    run_dir = load_config(RECIPE, overrides).run_dir()
    env = {**os.environ, "RAY_ADDRESS": "local", "PYTHONUNBUFFERED": "1"}
    cli = [sys.executable, "-m", "rltrain.cli"]
    driver = subprocess.Popen(
        [*cli, "train", str(RECIPE), *overrides],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: 1 in metrics_of(run_dir), timeout_s=600, what="step 1")
        driver.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        driver.send_signal(signal.SIGUSR1)
        out, err = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == PREEMPTED_EXIT_CODE, err[-6000:]
    assert "Traceback" not in out + err
    last = err.strip().splitlines()[-1]
    found = re.fullmatch(
        r"rltrain train: stopped by SIGTERM after step (\d); its checkpoint is (\S+); resume with: (.+)", last
    )
    assert found, err[-3000:]
    step, checkpoint, command = int(found[1]), found[2], shlex.split(found[3])
    ckpt = run_dir / "checkpoints"
    assert 1 <= step < STEPS and checkpoint == str(ckpt / f"step_{step}")
    assert (ckpt / "latest").read_text().strip() == f"step_{step}"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", f"step_{step}"]  # no partial save
    assert "rltrain: WARNING: SIGTERM received: saving a checkpoint at this step's end, then stopping" in err
    assert command == ["rltrain", "train", str(RECIPE), *overrides]

    shared_ray = {**env, "RAY_ADDRESS": fault_ray.get_runtime_context().gcs_address}
    resumed = subprocess.run(
        [*cli, *command[1:]], env=shared_ray, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert f"resumed from {ckpt / f'step_{step}'} (step {step})" in (run_dir / "rltrain.log").read_text()
    assert_same_metrics(metrics_of(run_dir), reference.metrics, range(1, STEPS + 1))
