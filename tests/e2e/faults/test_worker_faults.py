"""Automatic recovery for real: in one run with ``trainer.max_restarts=2``, the policy worker's process
is SIGKILLed during the first step (before any checkpoint: the run starts again from step 0), then,
after the restart, the critic's process is SIGSTOPped once step 2 is saved (found at the next call's
``trainer.timeouts.compute_s`` bound: the run resumes from step 2). Every worker group is torn down
each time (the stopped process too), and the metrics of all steps equal the uninterrupted run's.
"""

import logging
import os
import re
import signal

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
from rltrain.trainer.recovery import RECOVER_SECONDS, RESTARTS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_killed_then_a_stopped_worker_recover_to_the_uninterrupted_metrics(
    local_ray, fault_cache, reference, tmp_path, worker_groups, caplog
):
    groups = worker_groups
    config = load_config(RECIPE, fault_overrides(tmp_path, fault_cache, "trainer.max_restarts=2"))
    run_dir, latest = config.run_dir(), config.run_dir() / "checkpoints" / "latest"
    stopped = []

    def sabotage() -> None:
        # the critic is the last group to start: the driver is then starting step 1
        wait_for(lambda: len(groups) == 2, timeout_s=300, what="worker groups")
        assert [g.role for g in groups] == ["actor_rollout_ref", "critic"]
        assert not latest.exists()
        os.kill(groups[0].pids[0], signal.SIGKILL)
        wait_for(lambda: len(groups) == 4, timeout_s=300, what="restarted worker groups")
        wait_for(
            lambda: latest.exists() and latest.read_text().strip() == "step_2",
            timeout_s=300,
            what="checkpoint step_2 after the restart",
        )
        stopped.append(groups[3].pids[0])
        os.kill(stopped[0], signal.SIGSTOP)

    caplog.set_level(logging.INFO)
    train_sabotaged(config, sabotage, stopped=stopped)

    said = [r.getMessage() for r in caplog.records if r.name == "rltrain.trainer.recovery"]
    assert len(said) == 4, said
    assert re.fullmatch(
        r"actor_rollout_ref rank 0 \((rank_info|sync_weights|generate)\): the worker process died \(\w+Error\): "
        r"restarting every worker group and resuming from the last good checkpoint "
        r"\(restart 1 of 2, trainer\.max_restarts\)",
        said[0],
    ), said[0]
    assert re.fullmatch(
        r"restart 1 of 2: no checkpoint yet: started again from step 0, \d+\.\d s after the failure", said[1]
    ), said[1]
    assert said[2] == (
        "critic rank 0 (compute_values): no answer within 20 s (trainer.timeouts.compute_s): restarting "
        "every worker group and resuming from the last good checkpoint (restart 2 of 2, trainer.max_restarts)"
    )
    assert re.fullmatch(r"restart 2 of 2: resumed from step 2, \d+\.\d s after the failure", said[3]), said[3]

    got = metrics_of(run_dir)
    assert_same_metrics(got, reference.metrics, range(1, STEPS + 1))
    assert (got[1][RESTARTS], got[3][RESTARTS]) == (1, 2) and RESTARTS not in got[2]
    # from the failure (the timeout's end) to training again: at least the new start of both groups
    starts = [
        float(m[1])
        for r in caplog.records
        if (m := re.fullmatch(r"starting .* \.\.\. done in (\d+\.\d) s", r.getMessage()))
    ]
    assert len(starts) == 3, starts  # both groups start at once on CPU: one line a start
    assert starts[2] - 0.2 <= got[3][RECOVER_SECONDS] < starts[2] + 30, (starts, got[3])
    assert f"{got[3][RECOVER_SECONDS]:.1f} s after the failure" in said[3]
    assert latest.read_text().strip() == f"step_{STEPS}"
    # every group of the failed attempts is gone, the stopped process too; the last ones with the run
    wait_for(
        lambda: not any(running(pid) for group in groups for pid in group.pids),
        timeout_s=30,
        what="exit of every worker process",
    )
