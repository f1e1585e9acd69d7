"""``rollout.name`` (verl's key) picks the engine backend: ``vllm`` by default, an unknown name is
one config error naming the key and the known backends; the vLLM backend reads its own options
(``VllmOptions``) from the existing keys."""

from pathlib import Path

import pytest

from rltrain.config import ConfigError, load_config
from rltrain.rollout.vllm.options import VllmOptions
from rltrain.workers.rollout_worker import engine_settings

QUICKSTART = Path(__file__).resolve().parents[3] / "recipes" / "quickstart_cpu.yaml"


def test_rollout_name_defaults_to_vllm():
    assert load_config(QUICKSTART).rollout.name == "vllm"


def test_an_unknown_rollout_name_is_one_error_naming_the_key_and_the_known_names():
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, ["rollout.name=sglang"])
    assert info.value.problems == [
        "override 'rollout.name=sglang': rollout.name: unknown rollout engine 'sglang'; known: vllm"
    ]


def test_the_vllm_options_come_from_the_existing_keys():
    config = load_config(
        QUICKSTART, ["rollout.kv_cache_space_gb=0.5", "rollout.weight_sync.engine_load=reload"]
    )
    settings = engine_settings(config)
    assert settings.options == VllmOptions(kv_cache_space_gb=0.5, weight_load="reload")
    assert settings.options.logprobs_mode == "raw_logprobs" and settings.options.multiprocess is None
