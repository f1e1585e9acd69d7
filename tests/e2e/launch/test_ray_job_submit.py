"""`ray job submit --working-dir . -- rltrain train ...` against a Ray head started with `ray start`."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
RAY = [sys.executable, "-m", "ray.scripts.scripts"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    """`ray start --head` on 127.0.0.1 with 2 CPUs, in its own session; stopped by killing that session."""
    gcs, dash = free_port(), free_port()
    temp_dir = (
        f"/tmp/rt-{gcs}"  # short (unix socket paths) and unique: teardown finds this head's processes by it
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    head = subprocess.Popen(
        [
            *RAY,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            "--num-cpus=2",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            "--include-dashboard=true",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
        ],
        env=env,
        start_new_session=True,
        stdout=(tmp_path / "ray_head.log").open("w"),  # a file: an unread pipe would block the head
        stderr=subprocess.STDOUT,
        text=True,
    )
    address = f"http://127.0.0.1:{dash}"
    deadline = time.monotonic() + 180
    while (
        subprocess.run([*RAY, "job", "list", "--address", address], env=env, capture_output=True).returncode
        != 0
    ):
        assert head.poll() is None, (tmp_path / "ray_head.log").read_text()
        assert time.monotonic() < deadline, "Ray head did not accept job submissions within 3 minutes"
        time.sleep(2)
    yield address, env
    os.killpg(head.pid, signal.SIGTERM)
    try:
        # `ray start --block` stops its daemons gracefully on SIGTERM, which took 33 s on CI; the
        # test has checked what it needs, so after 5 s the rest are killed
        head.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()
    # Ray's daemons leave the head's process group; stop exactly those of this head.
    subprocess.run(["pkill", "-9", "-f", f"{temp_dir}/"], check=False)


def test_ray_job_submit_runs_the_quickstart_one_step_off(ray_head, tmp_path):
    address, env = ray_head
    run_root = tmp_path / "runs"
    deadline = time.monotonic() + 180
    while True:  # the head answers `job list` before its job agent accepts submissions
        submit = subprocess.run(
            [
                *RAY,
                "job",
                "submit",
                "--address",
                address,
                "--no-wait",
                "--working-dir",
                str(ROOT),
                "--",
                sys.executable,
                "-m",
                "rltrain.cli",
                "train",
                "recipes/quickstart_cpu.yaml",
                f"trainer.default_local_dir={run_root}",
                f"model.cache_dir={tmp_path / 'cache'}",
                "trainer.total_training_steps=3",
                "critic.warmup_steps=0",
                "trainer.save_freq=2",
                "trainer.test_freq=0",
                # generation overlapping training: the engines in a process of their own
                "trainer.pipeline=one_step_off",
                "rollout.mode=separate",
                "rollout.num_devices=1",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        if "No available agent" not in submit.stdout + submit.stderr or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    job_id = re.search(r"raysubmit_[A-Za-z0-9]+", submit.stdout + submit.stderr).group(0)  # no ANSI codes
    deadline = time.monotonic() + 900
    while True:
        status = subprocess.run(
            [*RAY, "job", "status", "--address", address, job_id], env=env, capture_output=True, text=True
        )
        # the CLI reports through its logger (stderr): "Job '...' succeeded" / "failed" / "stopped"
        said = " ".join(
            line.lower() for line in (status.stdout + status.stderr).splitlines() if job_id in line
        )
        if any(f"{word}" in said for word in ("succeeded", "failed", "stopped")):
            break
        assert time.monotonic() < deadline, "job did not finish within 15 minutes"
        time.sleep(3)
    logs = subprocess.run(
        [*RAY, "job", "logs", "--address", address, job_id], env=env, capture_output=True, text=True
    ).stdout
    assert "succeeded" in said, said + logs[-5000:]
    assert "joined the running Ray cluster" in logs  # the job's driver used the submitted-to cluster
    run_dir = run_root / "quickstart" / "tiny_llama_arith"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    # batch 1 from the initial weights, every later one generated while the batch before trained
    assert [r["async/staleness_max"] for r in records[1:]] == [0.0, 1.0, 1.0]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_3"
    # the step-2 checkpoint kept batch 3, generated ahead under the weights of step 1
    kept = json.loads((run_dir / "checkpoints" / "step_2" / "pipeline.json").read_text())["batches"]
    assert [(b["step"], b["version"]) for b in kept] == [(3, 1)]
    assert (run_dir / "config.yaml").exists() and (run_dir / "tensorboard").is_dir()
