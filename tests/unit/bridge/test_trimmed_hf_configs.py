"""A ``config.json`` may leave out every key whose value transformers gives its ``model_type`` anyway
(hand-written and trimmed configs do; ``AutoConfig`` loads them as the same model): the bridge reads
such a config exactly as the full one. Each family declares the transformers defaults of the keys it
reads (``ModelFamily.hf_defaults``); here the tables are checked against the installed transformers."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from megatron_bridge.bridge import Bridge
from megatron_bridge.hf_config import config_value
from megatron_bridge.layout import layout_problems
from megatron_bridge.registry import family_types, get_family
from rltrain.models.tiny import tiny_hf_config
from tests.unit.bridge.trimmed_configs import as_transformers_loads_it, config_json, trimmed

FAMILIES = family_types()

# The "released" configs: each transformers config class with its defaults (most describe a released
# model: Mixtral-8x7B, Qwen1.5-MoE-A2.7B, DeepSeek-V3), with these overrides: Qwen3-30B-A3B
# renormalizes its top-k; DeepSeek-V2-Lite's routing and direct query projection.
RELEASED_OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"norm_topk_prob": True},
    "deepseek_v2": {"q_lora_rank": None, "num_experts_per_tok": 6, "first_k_dense_replace": 1},
}

# The configuration of the report (issue 42): DeepSeek-V3 routing to 8 experts in 4 of 8 groups, as
# the released model does, so a config.json may leave num_experts_per_tok, n_group, topk_group out.
REPORTED_V3 = {"n_routed_experts": 16, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4}


def what_the_bridge_reads(config: dict[str, Any]) -> tuple:
    """Everything the bridge makes of a config: facts, shapes, the mapping table at TP=2, and the
    layout problems at a few parallel sizes."""
    bridge = Bridge.from_hf_config(config, tp_size=2)
    table = [(u.megatron_names, u.hf_names, u.tied) for u in bridge.units]
    layouts = [
        layout_problems(config, tp=tp, pp=pp, ep=ep) for tp, pp, ep in ((1, 1, 1), (2, 2, 2), (8, 4, 8))
    ]
    return get_family(config["model_type"]).facts(config), bridge.dims, table, layouts


def released_config(model_type: str) -> dict[str, Any]:
    from transformers import CONFIG_MAPPING

    return config_json(CONFIG_MAPPING[model_type](**RELEASED_OVERRIDES.get(model_type, {})))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_trimmed_tiny_config_reads_like_the_full_one(model_type):
    full = config_json(tiny_hf_config(model_type, vocab_size=448))
    short = trimmed(full)
    assert as_transformers_loads_it(short) == as_transformers_loads_it(full)
    assert set(short) < set(full)
    assert what_the_bridge_reads(short) == what_the_bridge_reads(full)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_trimmed_released_config_reads_like_the_full_one(model_type):
    """The released model's config trimmed to its ``model_type`` (and the overrides)."""
    full = released_config(model_type)
    short = trimmed(full)
    assert short == {"model_type": model_type, **RELEASED_OVERRIDES.get(model_type, {})}
    assert what_the_bridge_reads(short) == what_the_bridge_reads(full)


def test_deepseek_v3_config_without_the_reported_keys_reads_like_the_full_one():
    full = config_json(tiny_hf_config("deepseek_v3", vocab_size=448, **REPORTED_V3))
    left_out = ("num_experts_per_tok", "n_group", "topk_group", "rms_norm_eps")
    short = {k: v for k, v in full.items() if k not in left_out}
    assert as_transformers_loads_it(short) == as_transformers_loads_it(full)
    facts = get_family("deepseek_v3").facts(short)
    assert (facts.moe.top_k, facts.moe.num_groups, facts.moe.group_topk) == (8, 8, 4)
    assert what_the_bridge_reads(short) == what_the_bridge_reads(full)


def _class_defaults(model_type: str) -> dict[str, Any]:
    """The field defaults of the transformers config class of ``model_type``: what a key left out of
    a config.json is before the class's ``__post_init__`` derives anything from the others."""
    from transformers import CONFIG_MAPPING

    fields = dataclasses.fields(CONFIG_MAPPING[model_type])
    return {
        f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        for f in fields
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }


@pytest.mark.parametrize("model_type", FAMILIES)
def test_declared_defaults_are_the_installed_transformers_defaults(model_type):
    declared = dict(get_family(model_type).hf_defaults)
    defaults = _class_defaults(model_type)
    unknown = sorted(set(declared) - set(defaults))
    assert not unknown, f"{model_type}: {unknown} are no fields of transformers' config class"
    differ = {
        key: (value, defaults[key])
        for key, value in declared.items()
        if type(value) is not type(defaults[key]) or value != defaults[key]
    }
    assert not differ, f"{model_type}: declared default, transformers' default: {differ}"


class _Recording(dict):
    """A config.json dict that records which keys are looked up."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.looked_up: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.looked_up.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.looked_up.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.looked_up.add(str(key))
        return super().__contains__(key)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_key_the_bridge_reads_has_its_transformers_default_declared(model_type):
    """A key the bridge reads that transformers' config class defines must be in the family's table,
    or a config.json that leaves it out would be read differently from ``AutoConfig``."""
    looked_up: set[str] = set()
    for full in (config_json(tiny_hf_config(model_type, vocab_size=448)), released_config(model_type)):
        recording = _Recording(full)
        what_the_bridge_reads(recording)
        looked_up |= recording.looked_up
    fields = set(_class_defaults(model_type))
    missing = sorted((looked_up & fields) - set(get_family(model_type).hf_defaults))
    assert not missing, f"{model_type} reads {missing} without declaring transformers' defaults"


def test_a_key_set_to_null_stays_null_and_an_alias_counts_as_its_key():
    v3 = {"model_type": "deepseek_v3"}
    assert config_value(v3, "q_lora_rank") == 1536  # left out: transformers' default
    assert config_value({**v3, "q_lora_rank": None}, "q_lora_rank") is None  # null: no query latent
    assert config_value({**v3, "num_local_experts": 16}, "n_routed_experts", "num_local_experts") == 16
    assert config_value({"num_experts_per_tok": 2}, "num_experts_per_tok") == 2  # no model_type: as is
    assert config_value({}, "num_experts_per_tok", default=3) == 3


def test_a_key_an_older_transformers_class_lacks_reads_as_the_familys_default():
    """transformers 5.16–5.18's ``GptOssConfig`` has no ``swiglu_alpha``/``swiglu_limit`` (the model
    hard-codes 1.702 and 7.0; 5.19 made them config keys): an instance without them reads as the family's
    defaults, as transformers computes, where it used to stop the actor's start-up with
    ``float(None)``. A key the instance sets to None stays None."""
    from types import SimpleNamespace

    from megatron_bridge.models.gpt_oss import gpt_oss_facts

    # what a 5.18 instance holds: every attribute of today's but those two
    attributes = tiny_hf_config("gpt_oss", vocab_size=448).to_dict()
    config = SimpleNamespace(
        **{k: v for k, v in attributes.items() if k not in ("swiglu_alpha", "swiglu_limit")}
    )
    assert config.model_type == "gpt_oss"
    assert gpt_oss_facts(config).clamped_glu_limit == 7.0
    assert config_value(config, "swiglu_alpha") == 1.702
    config.swiglu_limit = None
    assert config_value(config, "swiglu_limit") is None
