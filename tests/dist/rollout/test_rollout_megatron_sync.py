"""Megatron actor at TP=2 (gloo) → weight sync → vLLM: vLLM's logprobs of its own samples equal the
actor's recomputed logprobs within 1e-3 (fp32), after the first sync and after an optimizer step."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tp2_model(out: Path, seed: int) -> Path:
    """The tiny llama with its 393-token vocab padded to 394 rows (Megatron needs vocab % TP == 0)."""
    from rltrain.models.tiny import build_tiny_model

    model, tokenizer = build_tiny_model("llama", seed=seed)
    model.resize_token_embeddings(394, mean_resizing=False)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_megatron_tp2_sync_logprobs_match_vllm(tmp_path):
    engine_dir = save_tp2_model(tmp_path / "engine", seed=0)
    actor_dir = save_tp2_model(tmp_path / "actor", seed=1)
    out = tmp_path / "result.json"
    worker = Path(__file__).with_name("megatron_sync_worker.py")
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
        cmd = [sys.executable, str(worker), str(engine_dir), str(actor_dir), str(out)]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    try:
        logs = [p.communicate(timeout=420)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log[-5000:]}"
    result = json.loads(out.read_text())
    print(json.dumps(result))
    before, first, second = result["runs"]
    assert before["logprob_abs_diff_max"] > 0.05  # engine and actor started from different weights
    assert first["num_tensors"] == second["num_tensors"] == 21
    assert first["logprob_abs_diff_max"] < 1e-3, first
    assert result["checksum_problems"] == []
    assert not result["step_skipped"] and result["step_logprob_change"] > 1e-2
    assert second["logprob_abs_diff_max"] < 1e-3, second
    assert abs(second["importance_ratio_mean"] - 1.0) < 1e-3
