"""The run's reaper with real processes: what the run started dies with it, at its end or its death;
nothing unmarked is touched."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from rltrain.orchestrator.reaper import RUN_MARK_ENV, marked_processes, reaped_run


def gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def test_processes_started_in_the_run_die_at_its_end_and_others_live(tmp_path):
    outside = subprocess.Popen(["sleep", "60"])
    try:
        with reaped_run() as token:
            assert os.environ[RUN_MARK_ENV] == token
            # a grandchild in a session of its own, orphaned at once: only its mark finds it
            started = subprocess.run(
                ["bash", "-c", "setsid sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True
            )
            orphan = int(started.stdout)
            child = subprocess.Popen(["sleep", "60"])
            # until the child has exec'd, /proc shows the environment it was forked with (the mark
            # is set by putenv, in the parent's heap): the watcher scans again, as this does
            deadline = time.monotonic() + 5.0
            while (
                sorted(marked_processes(token)) != sorted([orphan, child.pid]) and time.monotonic() < deadline
            ):
                time.sleep(0.02)
            assert sorted(marked_processes(token)) == sorted([orphan, child.pid])
        assert RUN_MARK_ENV not in os.environ
        assert gone(orphan) and gone(child.pid)
        child.wait(timeout=5)
        assert child.returncode == -signal.SIGKILL
        assert outside.poll() is None
    finally:
        outside.kill()


@pytest.mark.parametrize("env", ["inherited", "cleared"])
def test_a_killed_driver_takes_its_processes_along(tmp_path, env):
    """A driver (here a child python) SIGKILLed inside ``reaped_run``: the watcher kills what it started,
    marked or not (``cleared``: a process whose environment no longer shows the mark, as a process
    that renamed itself over it; the watcher saw it below the driver)."""
    pid_file = tmp_path / "pid"
    env_arg = ", env={}" if env == "cleared" else ""
    driver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "from rltrain.orchestrator.reaper import reaped_run\n"
            "with reaped_run():\n"
            f"    p = subprocess.Popen(['/bin/sleep', '60']{env_arg})\n"
            "    time.sleep(1.5)\n"  # the watcher notes the processes below the driver every 0.5 s
            f"    open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "    time.sleep(60)\n",
        ]
    )
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and driver.poll() is None
            time.sleep(0.05)
        sleeper = int(pid_file.read_text())
        assert not gone(sleeper, timeout_s=0.3)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=5)
        assert gone(sleeper, timeout_s=5)
    finally:
        driver.kill()
