"""A tiny model's ``model_type`` is any registered model family: adding a family file is enough."""

import pytest

from megatron_bridge.registry import family_types
from rltrain.config import ConfigError, load_config


def test_every_registered_family_is_a_valid_tiny_model_type():
    assert "qwen3_moe" in family_types()  # the one the old fixed list missed
    for model_type in family_types():
        config = load_config("recipes/quickstart_cpu.yaml", [f"model.tiny.model_type={model_type}"])
        assert config.model.tiny.model_type == model_type


def test_an_unknown_tiny_model_type_names_the_override_and_the_families():
    with pytest.raises(ConfigError) as err:
        load_config("recipes/quickstart_cpu.yaml", ["model.tiny.model_type=gpt2"])
    assert str(err.value) == (
        "invalid configuration: override 'model.tiny.model_type=gpt2': model.tiny.model_type='gpt2' has no "
        "model family; supported: " + ", ".join(family_types())
    )
