"""tools/slurm/ray_cluster.sbatch on a real one-node Slurm (Debian's slurm-wlm on localhost).

The fixture installs and starts munged, slurmctld and slurmd (tests/e2e/slurm/start_local_slurm.sh,
root needed) and cancels the jobs of the tests' name that an earlier run left in the queue: Slurm's
state outlives its daemons, and a job whose processes died with them comes back as running when the
daemons restart, holding the (exclusive) node until slurmctld gives up on it half an hour later.
The job gets SIGUSR1 (what the script asks Slurm to send ahead of its time limit), saves, requeues
itself and resumes. The script's start, join, run and teardown are tested on two nodes
(``test_slurm_two_nodes.py``).

The jobs' helpers (bounds, reports, cancelling) are in ``tests/e2e/slurm/jobs.py``.
"""

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.slurm.jobs import JOB_TIMEOUT_S, Job, start_local_slurm
from tests.e2e.slurm.jobs import submit as submit_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def slurm() -> tuple[str, int]:
    """The local node's name and CPU count, once no earlier test job is left in the queue."""
    (node,) = start_local_slurm()
    return node


def submit(cpus: int, tmp_path: Path, overrides: list[str]) -> Job:
    # one local node: its host name need not resolve (on this machine `x` resolves nowhere)
    return submit_job(tmp_path, overrides, cpus=cpus, env=("RAY_HEAD_IP=127.0.0.1",))


def test_sigusr1_saves_and_the_job_requeues_itself_and_resumes(slurm, tmp_path):
    """What Slurm does ahead of a time limit with the script's ``--signal=B:USR1@300``, sent at once:
    the batch shell passes SIGUSR1 to the driver, which saves its step (``save_freq=0`` would not) and
    exits 75; the script requeues the job, whose next run resumes from that checkpoint and finishes."""
    _, cpus = slurm
    run_dir = tmp_path / "runs" / "quickstart" / "tiny_llama_arith"
    metrics = run_dir / "metrics.jsonl"
    # Steps to spare after step 1: the signal goes out once step 1 is logged and reaches the driver
    # through scancel and the batch shell; at 0.65 s a step (an idle machine) it once arrived during
    # step 3 of 3, and a run that finishes has nothing to requeue.
    steps = 8
    job = submit(
        cpus,
        tmp_path,
        [
            "model.tiny.sft_warmup_steps=20",
            f"trainer.total_training_steps={steps}",
            "critic.warmup_steps=0",
            "trainer.save_freq=0",
        ],
    )
    try:
        job.wait(
            "step 1 in metrics.jsonl",
            lambda: metrics.exists() and '"step": 1' in metrics.read_text(),
            timeout_s=JOB_TIMEOUT_S,
        )
        subprocess.run(["scancel", "--batch", "--signal=USR1", job.job_id], check=True, timeout=30)
        job.wait("requeue", lambda: "rltrain: requeueing job" in job.log(), timeout_s=300)
        # a requeued job waits two minutes before it may start again; the test waits 5 s: a start in
        # the second of the requeue is refused ("Killing non-startable batch JobId=N: Job credential
        # revoked": slurmd compares the new credential's time with the revocation's, in seconds)
        job.wait("pending requeued job", lambda: job.state() == "PENDING", timeout_s=60)
        subprocess.run(
            ["scontrol", "update", f"JobId={job.job_id}", "StartTime=now+5"], check=True, timeout=30
        )
        state = job.wait_until_ended(timeout_s=JOB_TIMEOUT_S)
    finally:
        job.cancel()
    log = job.log()
    assert state == "COMPLETED", f"job {job.job_id} ended {state}\n{job.report()}"
    assert "rltrain: SIGUSR1 received: the run saves a checkpoint after its current step and stops" in log
    stopped = re.search(
        r"^rltrain\.train: stopped by SIGUSR1 after step (\d); its checkpoint is (\S+); ", log, re.M
    )
    assert stopped, log[-6000:]
    step = int(stopped[1])
    assert 1 <= step < steps and stopped[2] == str(run_dir / "checkpoints" / f"step_{step}")
    assert "rltrain: run 1 after a requeue: resuming from the last checkpoint" in log
    logged = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert logged == [0, *range(1, step + 1), 0, *range(step + 1, steps + 1)], logged
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{step}'} (step {step})" in log
