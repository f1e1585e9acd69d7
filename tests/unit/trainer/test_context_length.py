"""Prompts and responses longer than the model's context are refused before any worker starts, in
one line naming the keys and the model's limit (vLLM refused them inside an engine process)."""

import json

import pytest

from rltrain.config import load_config
from rltrain.errors import RunStopped
from rltrain.trainer.run import check_context_length


def _model(tmp_path, **config):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", **config}))
    return str(tmp_path)


def _config(*overrides):
    return load_config("recipes/quickstart_cpu.yaml", list(overrides))


def test_a_run_within_the_context_passes_and_one_past_it_is_refused_naming_the_keys(tmp_path):
    model = _model(tmp_path, max_position_embeddings=64)
    check_context_length(_config("data.max_prompt_length=58", "rollout.response_length=6"), model)
    with pytest.raises(RunStopped) as info:
        check_context_length(_config("data.max_prompt_length=64", "rollout.response_length=6"), model)
    assert str(info.value) == (
        "data.max_prompt_length + rollout.response_length = 70 exceeds the model's context of 64 tokens "
        f"(max_position_embeddings in {model}/config.json); vLLM refuses a longer max_model_len"
    )
    with pytest.raises(RunStopped, match=r"^rollout\.max_model_len = 80 exceeds the model's context of 64"):
        check_context_length(_config("rollout.max_model_len=80"), model)


def test_a_linear_or_dynamic_rope_factor_extends_the_context_and_yarn_does_not(tmp_path):
    long = _config("data.max_prompt_length=100", "rollout.response_length=20")
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    check_context_length(long, _model(tmp_path / "a", max_position_embeddings=64, rope_scaling=linear))
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "rope_theta": 1e4}
    with pytest.raises(RunStopped, match="exceeds the model's context of 64 tokens"):
        check_context_length(long, _model(tmp_path / "b", max_position_embeddings=64, rope_scaling=yarn))


def test_a_model_without_a_stated_context_is_not_checked(tmp_path):
    check_context_length(_config("data.max_prompt_length=4000"), _model(tmp_path))
