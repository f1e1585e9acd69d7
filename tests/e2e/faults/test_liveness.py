"""Frozen workers found by liveness, not by a step's deadline: one run at the default
``trainer.timeouts`` (compute 900 s, update 1800 s, ...) with ``trainer.max_restarts=3`` and the
asynchronous engine (its engine core is a child process of the policy rank). The critic's process is
SIGSTOPped once step 1 is saved; after the restart, the policy rank's process (actor, reference and
engine host); after the next, the engine core. Each is named within 60 s of its stop (the default
``liveness_s`` is 30 s), the run recovers each time (a failure while a restart starts is the next restart's), and the metrics of every step equal
the uninterrupted run's.
"""

import logging
import os
import re
import signal
import time

import psutil
import pytest
from fault_runs import (
    RECIPE,
    STEPS,
    assert_same_metrics,
    fault_overrides,
    metrics_of,
    running,
    train_sabotaged,
    wait_for,
)

from rltrain.config import load_config
from rltrain.trainer.recovery import RESTARTS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DEFAULT_DEADLINES = ("trainer.timeouts.compute_s=900", "trainer.timeouts.update_s=1800")
"""``fault_overrides`` shortens these for the deadline tests; this one runs at the defaults."""


def engine_core(pid: int) -> int:
    """The pid of the vLLM engine core among the process's children (the asynchronous engine's own
    process); other children (a compiler the engine runs, say) may come and go meanwhile."""
    found: list[int] = []

    def one_core() -> bool:
        cores: dict[int, int] = {}  # pid -> parent pid
        for child in psutil.Process(pid).children(recursive=True):
            try:
                if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                    cores[child.pid] = child.ppid()
            except psutil.NoSuchProcess:
                continue
        # a process the engine core forks (a compile worker) inherits its title: not another core
        found[:] = [core for core, parent in cores.items() if parent not in cores]
        return len(found) == 1

    wait_for(one_core, timeout_s=60, what=f"one engine core process under {pid}")
    return found[0]


def test_a_stopped_critic_actor_and_engine_are_named_within_60_s_and_recovered(
    local_ray, fault_cache, reference, tmp_path, worker_groups, caplog
):
    groups = worker_groups
    overrides = fault_overrides(
        tmp_path, fault_cache, *DEFAULT_DEADLINES, "trainer.max_restarts=3", "rollout.engine=async"
    )
    config = load_config(RECIPE, overrides)
    assert config.trainer.timeouts.liveness_s == 30.0  # the default
    latest = config.run_dir() / "checkpoints" / "latest"
    stopped: list[tuple[str, int, float]] = []  # (what, pid, when)
    stopped_pids: list[int] = []

    def stop(what: str, pid: int) -> None:
        stopped_pids.append(pid)
        os.kill(pid, signal.SIGSTOP)
        stopped.append((what, pid, time.time()))

    def sabotage() -> None:
        wait_for(lambda: len(groups) == 2, timeout_s=300, what="worker groups")
        wait_for(lambda: latest.exists(), timeout_s=300, what="checkpoint step_1")
        assert latest.read_text().strip() == "step_1"
        stop("critic", groups[1].pids[0])
        wait_for(lambda: len(groups) == 4, timeout_s=300, what="the first restart's worker groups")
        stop("policy", groups[2].pids[0])
        wait_for(lambda: len(groups) == 6, timeout_s=300, what="the second restart's worker groups")
        stop("engine", engine_core(groups[4].pids[0]))

    caplog.set_level(logging.INFO)
    train_sabotaged(config, sabotage, stopped=stopped_pids)

    said = [r for r in caplog.records if r.name == "rltrain.trainer.recovery"]
    # a failure during a restart's start is followed by the next restart, not by a "resumed" line
    failures = [r for r in said if "restarting every worker group" in r.getMessage()]
    assert len(failures) == 3, [r.getMessage() for r in said]
    expected = [
        rf"critic rank 0 \(.+\): its process \(pid {stopped[0][1]}\) gave no sign of life for \d+ s",
        rf"actor_rollout_ref rank 0 \(.+\): its process \(pid {stopped[1][1]}\) gave no sign of life for \d+ s",
        rf"actor_rollout_ref rank 0 \(.+\): its child process {stopped[2][1]} \(.+\) has been stopped for \d+ s",
    ]
    for i, (record, pattern, (what, _, when)) in enumerate(zip(failures, expected, stopped), start=1):
        line = record.getMessage()
        assert re.match(pattern, line), (what, line)
        assert "(trainer.timeouts.liveness_s=30)" in line, line
        assert line.endswith(
            f"restarting every worker group and resuming from the last good checkpoint "
            f"(restart {i} of 3, trainer.max_restarts)"
        ), line
        named_after = record.created - when
        print(f"{what}: named {named_after:.1f} s after its SIGSTOP: {line}")
        assert named_after < 60, (what, named_after)
    assert re.fullmatch(
        r"restart 3 of 3: resumed from step \d, \d+\.\d s after the failure", said[-1].getMessage()
    )

    got = metrics_of(config.run_dir())
    assert_same_metrics(got, reference.metrics, range(1, STEPS + 1))
    resumed_at = int(re.search(r"resumed from step (\d)", said[-1].getMessage())[1])
    assert got[resumed_at + 1][RESTARTS] == 3
    wait_for(
        lambda: not any(running(pid) for _, pid, _ in stopped),
        timeout_s=30,
        what="the end of every stopped process",
    )
