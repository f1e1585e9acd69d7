"""Helpers of the fault-injection tier: the shared overrides, metrics comparison, waiting, and a thread
that breaks a run while the test's thread drives it."""

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.wall_clock import WALL_CLOCK

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "quickstart_cpu.yaml"
STEPS = 3
# Wall-clock and throughput differ between runs by nature, and the restart metrics exist only in the
# recovered run; everything else must repeat.
NONDETERMINISTIC = (*WALL_CLOCK, "trainer/")


def fault_overrides(run_root: Path, cache: Path, *extra: str) -> list[str]:
    return [
        f"trainer.default_local_dir={run_root}",
        f"model.cache_dir={cache}",
        "model.tiny.sft_warmup_steps=20",
        f"trainer.total_training_steps={STEPS}",
        "critic.warmup_steps=0",
        "trainer.save_freq=1",
        "trainer.test_freq=0",
        "trainer.logger=[jsonl]",
        # a stopped worker is found within these (each call of the tiny model takes about a second,
        # a few on a loaded machine)
        "trainer.timeouts.compute_s=20",
        "trainer.timeouts.update_s=20",
        "trainer.timeouts.checkpoint_s=60",
        *extra,
    ]


def metrics_of(run_dir: Path) -> dict[int, dict]:
    """The last record of each step (a step redone after a failure replaces the first one)."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["step"]: r for r in records}


def assert_same_metrics(got: dict[int, dict], want: dict[int, dict], steps) -> None:
    for step in steps:
        a = {k: v for k, v in want[step].items() if not k.startswith(NONDETERMINISTIC)}
        b = {k: v for k, v in got[step].items() if not k.startswith(NONDETERMINISTIC)}
        assert a.keys() == b.keys(), (step, a.keys() ^ b.keys())
        for key in a:
            assert b[key] == pytest.approx(a[key], abs=1e-6), (step, key)


def wait_for(condition: Callable[[], bool], *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.05)


def run_signalled(
    cmd: list[str], *, env: dict[str, str], run_dir: Path, send: Callable[[subprocess.Popen], None]
) -> tuple[int, str]:
    """Run ``cmd``; once ``run_dir`` has logged step 1, ``send(process)`` (a signal, to it or to one of
    its children). Its exit code and what it wrote to stderr (stdout is dropped)."""
    process = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(lambda: 1 in metrics_of(run_dir), timeout_s=600, what="step 1")
        send(process)
        _, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, err


class Saboteur(threading.Thread):
    """Runs ``act`` beside a run driven from this thread; its failure is raised by :meth:`finish`."""

    def __init__(self, act: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self.act, self.error = act, None

    def run(self) -> None:
        try:
            self.act()
        except BaseException as err:  # reported in the test's thread
            self.error = err

    def finish(self) -> None:
        self.join(timeout=60)
        if self.error is not None:
            raise self.error


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a killed Ray worker may linger as one)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def train_sabotaged(config, sabotage: Callable[[], None], *, stopped: list[int]) -> None:
    """Train ``config`` to :data:`STEPS` in this thread while ``sabotage`` breaks it from another; the
    processes it SIGSTOPped (``stopped``, filled as it goes) are continued afterwards if still there
    (the restarts should have killed them; a stopped process is never left behind)."""
    from rltrain.orchestrator.entry import train

    saboteur = Saboteur(sabotage)
    saboteur.start()
    try:
        assert train(config) == STEPS
    finally:
        for pid in stopped:
            if running(pid):
                os.kill(pid, signal.SIGCONT)
    saboteur.finish()


@dataclass(frozen=True)
class Reference:
    metrics: dict[int, dict]
    """The records of the uninterrupted run by step."""
    run_dir: Path
