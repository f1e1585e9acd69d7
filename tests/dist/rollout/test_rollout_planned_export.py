"""The planner-driven weight stream (``rltrain.rollout.planned_export``) against the bridge's full
export, on 2 gloo ranks: trainer TP=2, PP=2, CP=2 (llama), EP=2 (mixtral) and GPT-OSS's stacked
experts at EP=2 and at TP=2 over EP=2 (expert-TP 1). See ``planned_export_worker.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from rank_launch import run_two_ranks

pytestmark = pytest.mark.dist


def run_ranks(tmp_path: Path, model_dir: Path, layout: str) -> dict:
    out = tmp_path / f"{layout}.json"
    return run_two_ranks("planned_export_worker.py", [str(model_dir), str(out), layout], out, timeout=300)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "cp2"])
def test_planned_stream_equals_full_export_llama(tmp_path, layout):
    from rltrain.models.tiny import save_tiny_model

    result = run_ranks(tmp_path, save_tiny_model(tmp_path / "model", "llama"), layout)
    assert result["num_tensors"] == 21
    halves = result["tp2"]
    # an engine rank at TP=2 receives its half of every split tensor, the small replicated ones whole
    for engine_rank in ("0", "1"):
        assert halves[engine_rank]["num_tensors"] == 21
        assert 0.45 < halves[engine_rank]["bytes"] / result["full_bytes"] < 0.55


def test_planned_stream_with_uneven_pipeline_stages(tmp_path):
    """3 layers at PP=2, 1 on the first stage and 2 on the last: the engine's tensors equal the HF ones."""
    from rltrain.models.tiny import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "model", "llama", num_hidden_layers=3)
    result = run_ranks(tmp_path, model_dir, "pp2_1+2")
    assert result["num_tensors"] == 30 == result["bit_exact_vs_checkpoint"]  # 3 + 9 per layer
    for engine_rank in ("0", "1"):
        assert result["tp2"][engine_rank]["num_tensors"] == 30
        assert 0.45 < result["tp2"][engine_rank]["bytes"] / result["full_bytes"] < 0.55


def test_planned_stream_equals_full_export_moe_ep2(tmp_path):
    from rltrain.models.tiny import save_tiny_model

    result = run_ranks(tmp_path, save_tiny_model(tmp_path / "model", "mixtral"), "ep2")
    assert result["num_tensors"] == 41
    # engine EP=2: each rank takes its half of the experts whole, the dense tensors TP-split
    total = sum(r["bytes"] for r in result["tp2"].values())
    assert result["full_bytes"] * 0.9 < total <= result["full_bytes"] * 1.1


@pytest.mark.supports("deepseek_v3", "mtp", "pp")
def test_planned_stream_of_a_pp2_model_with_an_mtp_layer(tmp_path):
    """DeepSeek-V3 with an MTP layer at PP=2: the last stage holds the MTP layer and a copy of the
    embedding; the stream carries the main model only (each tensor from one owner), bit-exact."""
    from rltrain.models.tiny import add_mtp_layers, save_tiny_model

    model_dir = save_tiny_model(tmp_path / "model", "deepseek_v3", num_mtp_layers=1)
    mtp = add_mtp_layers(model_dir)
    result = run_ranks(tmp_path, model_dir, "pp2")
    assert result["not_sent"] == sorted(mtp) and len(mtp) == 32
    assert result["num_tensors"] == 79 == result["bit_exact_vs_checkpoint"]


@pytest.mark.parametrize("layout", ["ep2", "tp2_ep2"])
def test_planned_stream_of_gpt_oss_stacked_experts(tmp_path, layout):
    """GPT-OSS stores a layer's experts as one stacked tensor: each EP rank serves its block of experts,
    the engine rank gets every expert's TP slice (interleaved gate/up columns) or its block of whole
    experts, bit for bit with the full export (random biases, so a misplaced block shows)."""
    from rltrain.models.tiny import randomize_all_weights, save_tiny_model

    model_dir = randomize_all_weights(save_tiny_model(tmp_path / "model", "gpt_oss"), seed=3)
    result = run_ranks(tmp_path, model_dir, layout)
    assert result["num_tensors"] == result["bit_exact_vs_checkpoint"] and not result["not_sent"]
    # engine EP=2: each rank its half of the experts whole; engine TP=2: half of each expert
    for key in ("tp2", "tp2_ep1"):
        assert set(result[key]) == {"0", "1"}
        total = sum(r["bytes"] for r in result[key].values())
        assert result["full_bytes"] * 0.9 < total <= result["full_bytes"] * 1.1, (key, total)
