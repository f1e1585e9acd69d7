"""The multi-process engine path (bucketed blob loads, worker-side digests), in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]


def test_multiprocess_engine_bucketed_load_digests_and_restore(tmp_path):
    from rltrain.models.tiny import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "model", "llama")
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    worker = Path(__file__).with_name("multiprocess_worker.py")
    proc = subprocess.run(
        [sys.executable, str(worker), str(model_dir), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result == {
        "in_process": False,
        "num_tensors": 21,
        "load_path": "direct",  # the workers load directly (direct_load) into their own models
        "digest_problems": [],
        "greedy_changed": True,
        "restored_bit_identical": True,
    }
