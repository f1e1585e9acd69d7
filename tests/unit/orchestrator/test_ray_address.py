"""Which Ray ``rltrain train`` uses (:mod:`rltrain.orchestrator.ray_connect`).

A cluster found on this machine is the one ``ray start`` recorded in ``<ray temp dir>/ray_current_cluster``
and only if its GCS answers (a head killed without ``ray stop`` leaves the file; ``ray.init(address=
"auto")`` would retry it for many minutes): the file here is Ray's own (found through ``RAY_TMPDIR``),
the live cluster a listening socket. Another process's private Ray instance is never joined, and a
cluster address that does not answer or refuses us fails in seconds, in one line.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rltrain.config import load_config
from rltrain.orchestrator.ray_connect import RayConnectionError, probe_cluster, recorded_cluster, resolve_ray

ROOT = Path(__file__).resolve().parents[3]


def _write_address(tmp_path, monkeypatch, address: str) -> None:
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "ray").mkdir(exist_ok=True)
    (tmp_path / "ray" / "ray_current_cluster").write_text(address)


def _closed_port() -> int:
    with socket.socket() as sock:  # a port that nothing listens on once the socket closes
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_stale_address_file_is_ignored_with_a_warning(tmp_path, monkeypatch, caplog):
    dead = f"127.0.0.1:{_closed_port()}"
    _write_address(tmp_path, monkeypatch, dead)
    with caplog.at_level(logging.WARNING):
        assert recorded_cluster(timeout_s=1.0) is None
    assert f"ignoring the Ray cluster address {dead}" in caplog.text


def test_an_answering_address_is_joined(tmp_path, monkeypatch):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        live = f"127.0.0.1:{server.getsockname()[1]}"
        _write_address(tmp_path, monkeypatch, live)
        assert recorded_cluster(timeout_s=1.0) == live


_LOCAL_PROBE = """
import ray
from rltrain.config import load_config
from rltrain.orchestrator.ray_connect import connect_ray
config = load_config("recipes/quickstart_cpu.yaml", ["cluster.num_cpus=1"])
started = connect_ray(config)
print("RESULT", started, ray.cluster_resources().get("CPU"))
ray.shutdown()
"""


def test_ray_address_local_starts_a_private_instance_even_beside_a_running_cluster():
    """``RAY_ADDRESS=local`` is Ray's word for "a new instance for this process": rltrain starts one
    with the config's CPUs (and so shuts it down at the end) instead of joining what the address
    file names. In a fresh interpreter: this one may already hold another test's Ray."""
    root = ROOT
    short = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # Ray's socket paths stay under 108 bytes
    try:
        with socket.socket() as server:  # an answering "cluster" that must not be joined
            server.bind(("127.0.0.1", 0))
            server.listen()
            (short / "ray").mkdir()
            (short / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{server.getsockname()[1]}")
            env = {
                **os.environ,
                "RAY_ADDRESS": "local",
                "RAY_TMPDIR": str(short),
                "RAY_AUTH_MODE": "disabled",
            }
            out = subprocess.run(
                [sys.executable, "-c", _LOCAL_PROBE],
                cwd=root,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
        assert "RESULT True 1.0" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_an_address_where_nothing_answers_fails_in_seconds_in_one_line(monkeypatch):
    dead = f"127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("RAY_ADDRESS", dead)
    config = load_config(ROOT / "recipes" / "quickstart_cpu.yaml")
    start = time.monotonic()
    with pytest.raises(RayConnectionError) as info:
        resolve_ray(config, timeout_s=2.0)
    assert time.monotonic() - start < 2.0
    assert str(info.value) == (
        f"cannot join the Ray cluster at {dead} (RAY_ADDRESS): nothing answers there ([Errno 111] "
        "Connection refused); to run on a private Ray instance of this run instead, set RAY_ADDRESS=local "
        "(or unset it)"
    )
    with pytest.raises(
        RayConnectionError,
        match=rf"^cannot join the Ray cluster at {dead} \(cluster.ray_address\)"
        r": .*, set cluster.ray_address=local$",
    ):
        probe_cluster(dead, source="cluster.ray_address", timeout_s=2.0)


# A run's private Ray: started by connect_ray with no address, held until stdin closes.
_PRIVATE_RUN = """
import sys, ray
from rltrain.config import load_config
from rltrain.orchestrator.ray_connect import connect_ray
started = connect_ray(load_config("recipes/quickstart_cpu.yaml", ["cluster.num_cpus=1"]))
node = ray._private.worker.global_worker.node
print("RUN", started, ray.get_runtime_context().gcs_address, node.session_name, flush=True)
sys.stdin.read()
ray.shutdown()
"""

# A process that is told to join ``RAY_ADDRESS`` with a wrong token.
_WRONG_TOKEN = """
import time
from rltrain.config import load_config
from rltrain.orchestrator.ray_connect import RayConnectionError, resolve_ray
start = time.monotonic()
try:
    resolve_ray(load_config("recipes/quickstart_cpu.yaml"))
except RayConnectionError as err:
    print("REFUSED", round(time.monotonic() - start, 1), err)
"""


def test_a_second_run_starts_its_own_ray_and_a_refusing_cluster_fails_in_seconds():
    """Two runs side by side on one machine: the second, given no address, does not join the first
    one's private Ray (``ray.init(address="auto")`` would: it scans the machine for running GCS
    processes) but starts its own. Both run with one token, so a join by accident would succeed.
    A process holding another token is refused by the first one's GCS within seconds, in one line."""
    short = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # Ray's socket paths stay under 108 bytes
    env = {**os.environ, "RAY_TMPDIR": str(short), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "a" * 32}
    env.pop("RAY_ADDRESS", None)

    def start_run() -> tuple[subprocess.Popen, list[str]]:
        proc = subprocess.Popen(
            [sys.executable, "-c", _PRIVATE_RUN],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = proc.stdout.readline()
        assert line.startswith("RUN "), line
        return proc, line.split()

    runs = []
    try:
        first, (_, started, gcs, session) = start_run()
        runs.append(first)
        assert started == "True"
        second, (_, started_too, gcs_too, session_too) = start_run()
        runs.append(second)
        assert started_too == "True" and gcs_too != gcs and session_too != session
        refused = subprocess.run(
            [sys.executable, "-c", _WRONG_TOKEN],
            cwd=ROOT,
            env={**env, "RAY_ADDRESS": gcs, "RAY_AUTH_TOKEN": "b" * 32},
            capture_output=True,
            text=True,
            timeout=120,
        )
        words = refused.stdout.split(" ", 2)
        assert words[0] == "REFUSED", refused.stdout[-2000:] + refused.stderr[-2000:]
        assert float(words[1]) < 5.0
        assert words[2].strip() == (
            f"cannot join the Ray cluster at {gcs} (RAY_ADDRESS): it refuses this process (RPC error: "
            "InvalidAuthToken: Authentication token is missing or incorrect: give it the cluster's token); "
            "to run on a private Ray instance of this run instead, set RAY_ADDRESS=local (or unset it)"
        )
    finally:
        for proc in runs:
            proc.stdin.close()
        for proc in runs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(short, ignore_errors=True)
