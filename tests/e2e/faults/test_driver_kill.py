"""Nothing of a run outlives a SIGKILLed driver: ``rltrain train`` on its private Ray instance (GCS,
raylet, the dashboard and runtime-env agents, the workers of the policy and the critic with the
engine) is killed with ``kill -9`` after its first step; 10 s later none of the processes it had
started is alive (before the reaper, Ray's agents stayed about 62 s).
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from fault_runs import RECIPE, ROOT, fault_overrides, metrics_of, wait_for

from rltrain.config import load_config
from rltrain.orchestrator.reaper import RUN_MARK_ENV

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def name_of(process: psutil.Process) -> str:
    """The process's name, or "" for one that ended since (a compiler a worker ran, say)."""
    try:
        return process.name()
    except psutil.NoSuchProcess:
        return ""


def living(processes: list[psutil.Process]) -> list[str]:
    """``pid name`` of each process still running (zombies, already dead, are not)."""
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{process.pid} {process.name()}")
        except psutil.NoSuchProcess:
            pass
    return alive


def test_no_process_of_a_run_is_alive_10_s_after_its_driver_is_sigkilled(fault_cache, tmp_path):
    overrides = fault_overrides(
        tmp_path, fault_cache, "trainer.total_training_steps=50", "trainer.save_freq=0"
    )
    run_dir = load_config(RECIPE, overrides).run_dir()
    env = {k: v for k, v in os.environ.items() if k != RUN_MARK_ENV}
    driver = subprocess.Popen(
        [sys.executable, "-m", "rltrain.cli", "train", str(RECIPE), *overrides],
        env={**env, "RAY_ADDRESS": "local", "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: 1 in metrics_of(run_dir) or driver.poll() is not None, timeout_s=600, what="step 1")
        assert driver.poll() is None, f"the driver ended by itself (exit {driver.returncode})"
        started = psutil.Process(driver.pid).children(recursive=True)
        names = {name_of(p) for p in started}
        # the run's own processes and Ray's daemons are there to be killed
        assert {"gcs_server", "raylet"} <= names, names
        assert any(name.startswith("ray::Dashboard") for name in names), names
        hosts = [p for p in started if name_of(p).startswith("ray::_RankHost")]
        assert len(hosts) >= 2, names  # the policy rank and the critic rank
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=10)
        killed_at = time.monotonic()
        time.sleep(10)
        assert living(started) == [], f"alive 10 s after the driver's SIGKILL: {living(started)}"
        print(f"{len(started)} processes of the run, none alive {time.monotonic() - killed_at:.1f} s later")
    finally:
        if driver.poll() is None:
            driver.kill()
