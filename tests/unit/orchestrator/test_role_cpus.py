"""RLTRAIN_ROLE_CPUS pins a role's processes: checked in a child process (pinning the test's own
would slow everything after it)."""

import os
import subprocess
import sys

import pytest

PROBE = (
    "import os, torch; from rltrain.orchestrator.worker_group import pin_to_role_cpus; "
    "pin_to_role_cpus(os.environ['ROLE']); "
    "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads(), os.environ.get('VLLM_CPU_OMP_THREADS_BIND'))"
)


def probe(role: str, spec: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    return subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**env, "RLTRAIN_ROLE_CPUS": spec, "ROLE": role},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one of them")
def test_a_role_runs_on_its_cpus_and_others_are_left_alone():
    allowed = sorted(os.sched_getaffinity(0))
    last = allowed[-1]
    pinned = probe("rollout", f"actor_rollout_ref={allowed[0]};rollout={last}")
    assert pinned.stdout.split() == [f"[{last}]", "1", str(last)], pinned.stderr
    spread = probe("critic", f"critic={allowed[0]}-{allowed[1]}")
    assert spread.stdout.split()[:2] == [f"[{allowed[0]},", f"{allowed[1]}]"], spread.stderr
    untouched = probe("critic", f"rollout={last}")
    assert untouched.stdout.startswith(str(allowed)), untouched.stderr


def test_a_bad_cpu_list_is_named():
    bad = probe("rollout", "rollout=one")
    assert "RLTRAIN_ROLE_CPUS='rollout=one': 'one' is not a CPU or a range like 0-3" in bad.stderr
