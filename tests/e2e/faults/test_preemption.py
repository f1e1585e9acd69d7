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


def test_under_torchrun_a_signal_to_one_rank_stops_every_rank_after_the_same_step(fault_cache, tmp_path):
    """SIGTERM to rank 1 alone: the ranks agree after the step, save it together (the role saves are
    collective) and stop; rank 0 prints the line and exits 75. torchrun itself reports that as a
    failure (its own exit code 1, naming exit code 75) and may stop the other rank, by then closing
    down after the save, with SIGTERM."""
    import psutil

    from rltrain.orchestrator.checkpoints import verify_path

    overrides = fault_overrides(
        tmp_path,
        fault_cache,
        "trainer.save_freq=0",
        "cluster.n_gpus_per_node=2",
        "actor.parallel.tensor_model_parallel_size=2",
        "critic.parallel.tensor_model_parallel_size=2",
    )
    run_dir = load_config(RECIPE, overrides).run_dir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1"]
    launcher = subprocess.Popen(
        [*torchrun, "--nproc_per_node", "2", "-m", "rltrain.train", str(RECIPE), *overrides],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: 1 in metrics_of(run_dir), timeout_s=600, what="step 1")
        ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(launcher.pid).children()}
        ranks[1].send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    (tmp_path / "torchrun.err").write_text(err)
    assert launcher.returncode == 1, err[-6000:]
    ours = [line for line in err.splitlines() if line.startswith("rltrain.train: ")]
    assert len(ours) == 1, err[-6000:]
    found = re.fullmatch(
        r"rltrain\.train: stopped by SIGTERM after step (\d); its checkpoint is (\S+); "
        r"resume with: the same torchrun command",
        ours[0],
    )
    assert found, ours
    step = int(found[1])
    assert 1 <= step < STEPS and found[2] == str(run_dir / "checkpoints" / f"step_{step}")
    assert "rltrain[rank 1]: WARNING: SIGTERM received" in err
    # the one traceback is torchrun's own report of ranks that exited non-zero
    assert err.count("Traceback") == 1 and "ChildFailedError" in err.split("Traceback")[1], err[-6000:]
    assert re.search(r"exitcode\s*: 75", err), err[-3000:]
    assert sorted(metrics_of(run_dir)) == list(range(step + 1))
    lines, all_well = verify_path(run_dir)
    assert all_well, lines
