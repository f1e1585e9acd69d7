"""Context-parallel recipes load and validate; what CP does not support is refused naming the key."""

from pathlib import Path

import pytest

from rltrain.config import ConfigError, load_config

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
CPU = RECIPES / "long_context_cpu.yaml"
GPU = RECIPES / "gpu" / "qwen2.5_7b_long_context_cp4_grpo.yaml"


def test_long_context_cpu_recipe_is_cp2_with_2k_responses():
    config = load_config(CPU)
    assert config.validate() == []
    assert config.actor.parallel.context_parallel_size == 2 and config.rollout.response_length == 2048
    assert config.cluster.backend == "gloo" and config.role_world("actor") == 2  # DP = 1
    assert config.ref.parallel is None  # the reference runs at the actor's CP=2


def test_long_context_gpu_recipe_is_cp4_tp2_with_16k_responses():
    config = load_config(GPU)
    assert config.validate() == []
    parallel = config.actor.parallel
    assert (parallel.context_parallel_size, parallel.tensor_model_parallel_size) == (4, 2)
    assert config.rollout.response_length == 16384
    assert parallel.data_parallel_size(config.role_world("actor")) == 2


def _problems(path: Path, overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value.problems


def test_cp_without_packing_is_refused_naming_the_key():
    (problem,) = _problems(CPU, ["actor.use_remove_padding=false"])
    assert "actor.use_remove_padding=false with actor.parallel.context_parallel_size=2" in problem


def test_dynamic_token_budget_counts_one_cp_rank_share():
    # (128 + 2048) = 2176 tokens: padded to a multiple of 2·CP = 4 (2176), halved: 1088 per CP rank.
    load_config(CPU, ["actor.ppo_max_token_len_per_gpu=1088"])
    (problem,) = _problems(CPU, ["actor.ppo_max_token_len_per_gpu=1087"])
    assert "actor.ppo_max_token_len_per_gpu=1087 is smaller than one sequence" in problem
    assert "1088 per rank at actor.parallel.context_parallel_size=2" in problem


def test_cp_that_does_not_divide_the_devices_is_refused():
    (problem,) = _problems(CPU, ["actor.parallel.context_parallel_size=3"])
    assert "actor.parallel: TP×PP×CP = 1×1×3 = 3 does not divide the 2 devices" in problem
