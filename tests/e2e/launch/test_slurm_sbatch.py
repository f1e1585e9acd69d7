"""tools/slurm/ray_cluster.sbatch on a real one-node Slurm (Debian's slurm-wlm on localhost).

The fixture installs and starts munged, slurmctld and slurmd (tests/e2e/slurm/start_local_slurm.sh,
root needed); the job starts a Ray head through srun, waits for the node, runs the quickstart for two
steps and stops Ray again.
"""

import json
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


def test_sbatch_runs_recipe_on_ray_cluster_and_tears_down(slurm, tmp_path):
    node, cpus = slurm[0], int(slurm[1])
    run_root, out = tmp_path / "runs", tmp_path / "job.out"
    gcs = free_port()
    agent_ports = f"--dashboard-agent-listen-port={free_port()} --dashboard-agent-grpc-port={free_port()}"
    env_vars = (
        f"ALL,RAY_PORT={gcs},RAY_DASHBOARD_PORT={free_port()},RLTRAIN_PYTHON={ROOT / '.venv' / 'bin' / 'python'},"
        f"RAY_TMP=/tmp/rs-{gcs},RAY_START_ARGS={agent_ports},"
        # one local node: its host name need not resolve (on this machine `x` resolves nowhere)
        "RAY_HEAD_IP=127.0.0.1"
    )
    job = subprocess.run(
        [
            "sbatch",
            "--wait",
            f"--export={env_vars}",
            "--nodes=1",
            f"--cpus-per-task={cpus}",
            f"--output={out}",
            f"--chdir={ROOT}",
            str(ROOT / "tools" / "slurm" / "ray_cluster.sbatch"),
            "recipes/quickstart_cpu.yaml",
            f"trainer.default_local_dir={run_root}",
            f"model.cache_dir={tmp_path / 'cache'}",
            "trainer.total_training_steps=2",
            "trainer.save_freq=2",
            "trainer.test_freq=0",
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
