"""The planner-driven weight stream (``rltrain.rollout.planned_export``) against the bridge's full
export, on 2 gloo ranks: trainer TP=2, PP=2 (llama) and EP=2 (mixtral). See ``planned_export_worker.py``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path: Path, model_dir: Path, layout: str) -> dict:
    out = tmp_path / f"{layout}.json"
    worker = Path(__file__).with_name("planned_export_worker.py")
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, str(worker), str(model_dir), str(out), layout]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log[-5000:]}"
    result = json.loads(out.read_text())
    print(json.dumps(result))
    return result


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_planned_stream_equals_full_export_llama(tmp_path, layout):
    from rltrain.models.tiny import save_tiny_model

    result = run_ranks(tmp_path, save_tiny_model(tmp_path / "model", "llama"), layout)
    assert result["num_tensors"] == 21
    halves = result["tp2"]
    # an engine rank at TP=2 receives its half of every split tensor, the small replicated ones whole
    for engine_rank in ("0", "1"):
        assert halves[engine_rank]["num_tensors"] == 21
        assert 0.45 < halves[engine_rank]["bytes"] / result["full_bytes"] < 0.55


def test_planned_stream_equals_full_export_moe_ep2(tmp_path):
    from rltrain.models.tiny import save_tiny_model

    result = run_ranks(tmp_path, save_tiny_model(tmp_path / "model", "mixtral"), "ep2")
    assert result["num_tensors"] == 41
    # engine EP=2: each rank takes its half of the experts whole, the dense tensors TP-split
    total = sum(r["bytes"] for r in result["tp2"].values())
    assert result["full_bytes"] * 0.9 < total <= result["full_bytes"] * 1.1
