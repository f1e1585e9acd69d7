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


def _file(tmp_path, config) -> str:
    path = tmp_path / "config.json"
    path.write_text(config if isinstance(config, str) else __import__("json").dumps(config))
    return str(path)


def test_a_tiny_model_from_a_config_file_takes_its_model_type_or_the_same_one(tmp_path):
    path = _file(tmp_path, {"model_type": "qwen3_moe", "hidden_size": 64})
    for extra in ([], ["model.tiny.model_type=qwen3_moe"]):
        config = load_config("recipes/quickstart_cpu.yaml", [f"model.tiny.config_path={path}", *extra])
        assert config.model.tiny.config_path == path


@pytest.mark.parametrize(
    ("content", "overrides", "message"),
    [
        (
            {"model_type": "qwen3_moe"},
            ["model.tiny.model_type=mixtral"],
            "model.tiny.model_type='mixtral', but ",
        ),
        ({"model_type": "qwen3_moe"}, ["model.tiny.hidden_size=256"], "model.tiny.hidden_size is set, but "),
        ({"model_type": "gpt2"}, [], "model_type='gpt2' has no model family; supported: "),
        ("{not json", [], "JSONDecodeError: "),
    ],
)
def test_a_bad_tiny_config_file_is_one_line_naming_the_key(tmp_path, content, overrides, message):
    path = _file(tmp_path, content)
    with pytest.raises(ConfigError) as err:
        load_config("recipes/quickstart_cpu.yaml", [f"model.tiny.config_path={path}", *overrides])
    assert message in str(err.value) and "\n" not in str(err.value)
    assert "model.tiny." in str(err.value)


def test_a_missing_tiny_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.tiny\.config_path=.*nothing\.json: FileNotFoundError"):
        load_config("recipes/quickstart_cpu.yaml", [f"model.tiny.config_path={tmp_path / 'nothing.json'}"])
