"""``rltrain train`` joins a Ray cluster found on this machine only if its GCS answers.

A head killed without ``ray stop`` leaves its address in ``<ray temp dir>/ray_current_cluster``;
``ray.init(address="auto")`` would retry it for many minutes. The address file here is Ray's own
(found through ``RAY_TMPDIR``); the live cluster is stood for by a listening socket (no Ray head is
started in the unit tier), and Ray's scan for running GCS processes is switched off so that a
cluster running on the machine (another test tier's) does not answer instead.
"""

from __future__ import annotations

import logging
import socket

from rltrain.orchestrator.entry import _running_cluster


def _write_address(tmp_path, monkeypatch, address: str) -> None:
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # Ray prefers a GCS process it finds running on this machine over the file; the e2e tier's
    # session cluster may be one. Only the file is under test here.
    monkeypatch.setattr("ray._private.services.find_gcs_addresses", lambda: [])
    (tmp_path / "ray").mkdir(exist_ok=True)
    (tmp_path / "ray" / "ray_current_cluster").write_text(address)


def test_a_stale_address_file_is_ignored_with_a_warning(tmp_path, monkeypatch, caplog):
    with socket.socket() as sock:  # a port that nothing listens on once the socket closes
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    _write_address(tmp_path, monkeypatch, dead)
    with caplog.at_level(logging.WARNING):
        assert _running_cluster(timeout_s=1.0) is None
    assert f"ignoring the Ray cluster address {dead}" in caplog.text


def test_an_answering_address_is_joined(tmp_path, monkeypatch):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        live = f"127.0.0.1:{server.getsockname()[1]}"
        _write_address(tmp_path, monkeypatch, live)
        assert _running_cluster(timeout_s=1.0) == live


_LOCAL_PROBE = """
import ray
from rltrain.config import load_config
from rltrain.orchestrator.entry import connect_ray
config = load_config("recipes/quickstart_cpu.yaml", ["cluster.num_cpus=1"])
started = connect_ray(config)
print("RESULT", started, ray.cluster_resources().get("CPU"))
ray.shutdown()
"""


def test_ray_address_local_starts_a_private_instance_even_beside_a_running_cluster():
    """``RAY_ADDRESS=local`` is Ray's word for "a new instance for this process": rltrain starts one
    with the config's CPUs (and so shuts it down at the end) instead of joining what the address
    file names. In a fresh interpreter: this one may already hold another test's Ray."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
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
