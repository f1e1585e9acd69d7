"""Broadcast transport over a real 2-process gloo group: trainer rank → engine rank holding vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rltrain.ports import HeldPort

pytestmark = [pytest.mark.dist, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[3]


def test_broadcast_sync_into_vllm_matches_sent_weights(tmp_path):
    from rltrain.models.tiny import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "model", "llama")
    worker = Path(__file__).with_name("broadcast_worker.py")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with HeldPort("127.0.0.1") as port:  # held until the ranks are done, so nothing else takes it first
        procs = [
            subprocess.Popen(
                [sys.executable, str(worker), str(rank), str(port.port), str(model_dir), str(tmp_path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in (0, 1)
        ]
        logs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log[-4000:]}"
    sent = json.loads((tmp_path / "rank0.json").read_text())
    got = json.loads((tmp_path / "rank1.json").read_text())
    assert got["mismatched"] == []  # every engine weight equals the sent tensor bit for bit
    assert got["greedy_changed"]
    assert sent["num_buckets"] == got["num_buckets"] >= 8
    assert sent["num_tensors"] == got["num_tensors"] == 21
    assert sent["num_bytes"] == got["num_bytes"]
