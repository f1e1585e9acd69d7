"""The released configs as test data: only size fields shrunk (or a setting the model card documents),
each with its reason; the shrunk config is one transformers builds, with the released architecture."""

from __future__ import annotations

import json

import pytest
from transformers import CONFIG_MAPPING

from megatron_bridge.hf_config import CONFIG_CLASS_OF
from tests.released import HERE, SIZE_KEYS, released_config, released_names, shrink_table, shrunk_config

NAMES = released_names()


def test_the_yarn_checkpoints_are_there() -> None:
    assert {"deepseek-v3", "qwen3-8b-yarn"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_change_is_a_size_field_or_documented_with_its_reason(name: str) -> None:
    table = shrink_table(name)
    assert table["source"].strip()
    assert set(table) <= {"source", "shrink", "documented"}
    for key, change in table["shrink"].items():
        assert key in SIZE_KEYS, f"{name}: {key} is not a size field"
        assert set(change) == {"value", "why"} and str(change["why"]).strip(), (name, key)
    for key, change in table.get("documented", {}).items():
        assert key not in SIZE_KEYS, f"{name}: {key} is a size field; list it under shrink"
        assert set(change) == {"value", "why", "cite"}, (name, key)
        assert str(change["why"]).strip() and str(change["cite"]).strip(), (name, key)


@pytest.mark.parametrize("name", NAMES)
def test_the_shrunk_config_differs_from_the_released_one_only_where_the_table_says(name: str) -> None:
    released, shrunk, table = released_config(name), shrunk_config(name), shrink_table(name)
    changed = {*table["shrink"], *table.get("documented", {})}
    top = {key.split(".")[0] for key in changed}
    assert {k for k in released if released[k] != shrunk[k]} <= top
    for key in released.keys() - top:
        assert shrunk[key] == released[key], (name, key)


@pytest.mark.parametrize("name", NAMES)
def test_the_released_file_is_valid_json_as_stored(name: str) -> None:
    text = (HERE / name / "config.json").read_text()
    assert json.loads(text) == released_config(name)


@pytest.mark.parametrize("name", NAMES)
def test_the_shrunk_config_loads_in_transformers(name: str) -> None:
    config = shrunk_config(name)
    config.pop("quantization_config", None)  # as save_released_model: the tiny model is not quantized
    model_type = config.pop("model_type")  # kimi_k2 reads as DeepseekV3Config (CONFIG_CLASS_OF)
    hf = CONFIG_MAPPING[CONFIG_CLASS_OF.get(model_type, model_type)].from_dict(config)
    for key, change in shrink_table(name)["shrink"].items():
        if "." not in key:
            assert getattr(hf, key) == change["value"], (name, key)


def test_qwen3_8b_gets_the_cards_yarn_block_at_a_shrunk_length() -> None:
    assert released_config("qwen3-8b-yarn")["rope_scaling"] is None
    config = shrunk_config("qwen3-8b-yarn")
    hf = CONFIG_MAPPING["qwen3"].from_dict(config)
    assert hf.rope_parameters == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 1000000,
    }


def test_deepseek_v3_keeps_its_released_yarn_and_mtp_settings() -> None:
    config = shrunk_config("deepseek-v3")
    assert config["rope_scaling"] == {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 16,
        "type": "yarn",
    }
    assert config["num_nextn_predict_layers"] == 1
    assert config["quantization_config"]["quant_method"] == "fp8"
