"""tools/slurm/ray_cluster.sbatch on a real one-node Slurm (Debian's slurm-wlm on localhost).

The fixture installs and starts munged, slurmctld and slurmd (tests/e2e/slurm/start_local_slurm.sh,
root needed); the job starts a Ray head through srun, waits for the node, runs the quickstart for two
steps and stops Ray again. A second job gets SIGUSR1 (what the script asks Slurm to send ahead of
its time limit), saves, requeues itself and resumes.
"""

import json
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slurm():
    subprocess.run(
        ["bash", str(ROOT / "tests" / "e2e" / "slurm" / "start_local_slurm.sh")], check=True, timeout=900
    )
    return subprocess.run(
        ["sinfo", "-h", "-o", "%n %c"], capture_output=True, text=True, check=True
    ).stdout.split()


def sbatch_args(cpus: int, tmp_path: Path, gcs: int, *, wait: bool) -> list[str]:
    """``sbatch`` of tools/slurm/ray_cluster.sbatch on the local node, Ray on free ports."""
    agent_ports = f"--dashboard-agent-listen-port={free_port()} --dashboard-agent-grpc-port={free_port()}"
    env_vars = (
        f"ALL,RAY_PORT={gcs},RAY_DASHBOARD_PORT={free_port()},RLTRAIN_PYTHON={ROOT / '.venv' / 'bin' / 'python'},"
        f"RAY_TMP=/tmp/rs-{gcs},RAY_START_ARGS={agent_ports},"
        # one local node: its host name need not resolve (on this machine `x` resolves nowhere)
        "RAY_HEAD_IP=127.0.0.1"
    )
    return [
        "sbatch",
        *(["--wait"] if wait else ["--parsable"]),
        f"--export={env_vars}",
        "--nodes=1",
        f"--cpus-per-task={cpus}",
        f"--output={tmp_path / 'job.out'}",
        f"--chdir={ROOT}",
        str(ROOT / "tools" / "slurm" / "ray_cluster.sbatch"),
        "recipes/quickstart_cpu.yaml",
        f"trainer.default_local_dir={tmp_path / 'runs'}",
        f"model.cache_dir={tmp_path / 'cache'}",
        "trainer.test_freq=0",
    ]


def test_sbatch_runs_recipe_on_ray_cluster_and_tears_down(slurm, tmp_path):
    node, cpus = slurm[0], int(slurm[1])
    run_root, out = tmp_path / "runs", tmp_path / "job.out"
    gcs = free_port()
    job = subprocess.run(
        [
            *sbatch_args(cpus, tmp_path, gcs, wait=True),
            "trainer.total_training_steps=2",
            "trainer.save_freq=2",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    log = out.read_text() if out.exists() else ""
    assert job.returncode == 0, job.stdout + job.stderr + log[-6000:]
    assert f"rltrain: 1 node(s) {node}" in log and "rltrain: all 1 node(s) joined" in log
    assert "joined the running Ray cluster" in log
    run_dir = run_root / "quickstart" / "tiny_llama_arith"
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_2"
    # torn down: nothing listens on the head's GCS port any more
    time.sleep(2)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", gcs)) != 0, "the Ray head is still running after the job"
    leftovers = subprocess.run(["pgrep", "-f", f"/tmp/rs-{gcs}/"], capture_output=True, text=True).stdout
    assert leftovers == "", f"Ray processes of the job survived it: {leftovers}"


def job_state(job_id: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    found = re.search(r"JobState=(\w+)", shown)
    return found[1] if found else "GONE"


def wait_until(condition, *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.5)


def test_sigusr1_saves_and_the_job_requeues_itself_and_resumes(slurm, tmp_path):
    """What Slurm does ahead of a time limit with the script's ``--signal=B:USR1@300``, sent at once:
    the batch shell passes SIGUSR1 to the driver, which saves its step (``save_freq=0`` would not) and
    exits 75; the script requeues the job, whose next run resumes from that checkpoint and finishes."""
    cpus = int(slurm[1])
    out, run_dir = tmp_path / "job.out", tmp_path / "runs" / "quickstart" / "tiny_llama_arith"
    metrics = run_dir / "metrics.jsonl"
    steps = 3
    submitted = subprocess.run(
        [
            *sbatch_args(cpus, tmp_path, free_port(), wait=False),
            "model.tiny.sft_warmup_steps=20",
            f"trainer.total_training_steps={steps}",
            "trainer.save_freq=0",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    job_id = submitted.stdout.strip().split(";")[0]
    try:
        wait_until(
            lambda: metrics.exists() and '"step": 1' in metrics.read_text(), timeout_s=900, what="step 1"
        )
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)
        wait_until(lambda: "rltrain: requeueing job" in out.read_text(), timeout_s=300, what="requeue")
        # a requeued job waits two minutes before it may start again; the test waits 5 s: a start in
        # the second of the requeue is refused ("Killing non-startable batch JobId=N: Job credential
        # revoked": slurmd compares the new credential's time with the revocation's, in seconds)
        wait_until(lambda: job_state(job_id) == "PENDING", timeout_s=60, what="pending requeued job")
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+5"], check=True)
        wait_until(
            lambda: job_state(job_id) in ("COMPLETED", "FAILED", "GONE"), timeout_s=900, what="job end"
        )
    finally:
        subprocess.run(["scancel", job_id], check=False)
    log = out.read_text()
    assert job_state(job_id) in ("COMPLETED", "GONE"), log[-6000:]
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
