"""Gemma 3 is recognized and refused in one line, by the bridge and by ``rltrain convert``; GPT-OSS's
released config (MXFP4 experts) is refused in one line naming ``quantization_config``.

The configs are the released ``config.json`` files (``tests/released``); the tiny transformers models
built from their shrinks show the configs are real and load in the installed transformers, and are
what ``rltrain convert`` is pointed at. The trainer's refusal is in
``tests/dist/megatron/test_megatron_family_config.py`` (it builds Megatron configs)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_bridge.bridge import Bridge
from megatron_bridge.layout import layout_problems
from megatron_bridge.refused import REFUSED
from megatron_bridge.registry import get_family, registered_family, supported_model_types
from rltrain.convert import cli, launch
from tests.released import released_config, save_released_model

RELEASED = {"gemma-3-1b-it": "gemma3_text"}


@pytest.mark.parametrize(("name", "model_type"), sorted(RELEASED.items()))
def test_the_released_config_is_refused_in_one_line(name: str, model_type: str) -> None:
    config = released_config(name)
    assert config["model_type"] == model_type
    for attempt in (lambda: get_family(model_type), lambda: Bridge.from_hf_config(config)):
        with pytest.raises(NotImplementedError) as err:
            attempt()
        (line,) = err.value.args
        assert line == REFUSED[model_type] and "\n" not in line
        assert line.startswith(f"{model_type} is not supported: ")
    # no family, so no mapping rows or tiny preset pretending to work
    assert registered_family(model_type) is None and model_type not in supported_model_types()


def test_the_refusals_name_the_missing_features() -> None:
    assert "gpt_oss" not in REFUSED and get_family("gpt_oss").name == "gpt_oss"
    for feature in ("rope_local_base_freq", "post-attention", "post-feedforward", "sqrt(hidden_size)"):
        assert feature in REFUSED["gemma3_text"]
    assert "in no Megatron-Core release through 0.16.1" in REFUSED["gemma3_text"]


@pytest.mark.parametrize(("name", "model_type"), sorted(RELEASED.items()))
def test_rltrain_convert_refuses_the_tiny_released_model(
    name: str, model_type: str, tmp_path, capsys, monkeypatch
) -> None:
    def no_rank(*args, **kwargs):
        raise AssertionError("a conversion rank was started for a refused model type")

    monkeypatch.setattr(launch, "_run_ranks", no_rank)
    hf = save_released_model(tmp_path / name, name)
    # the tiny model is a real one of the released architecture: transformers loads and runs it
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    assert model.config.model_type == model_type
    assert torch.isfinite(model(input_ids=torch.arange(12)[None]).logits).all()
    assert json.loads((hf / "config.json").read_text())["sliding_window"] == 8
    capsys.readouterr()  # transformers' progress bars
    assert cli.main(["hf-to-mcore", str(hf), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err == f"convert hf-to-mcore failed: {hf / 'config.json'}: {REFUSED[model_type]}\n"


def test_the_released_mxfp4_gpt_oss_config_is_refused_naming_quantization_config() -> None:
    """The released gpt-oss-20b stores its experts as MXFP4 blocks and scales: the family's facts, which
    ``rltrain convert`` (through ``layout_problems``) and the trainer read before any weight, refuse it
    in one line saying what to do; the same config without ``quantization_config`` (what a dequantized
    copy has) is read."""
    config = released_config("gpt-oss-20b")
    expected = (
        "gpt_oss: quantization_config.quant_method='mxfp4': the bridge reads unquantized weights only; "
        "dequantize first (transformers: from_pretrained with Mxfp4Config(dequantize=True), then save_pretrained)"
    )
    for attempt in (lambda: layout_problems(config, tp=1, pp=1), lambda: get_family("gpt_oss").facts(config)):
        with pytest.raises(NotImplementedError) as err:
            attempt()
        assert err.value.args == (expected,)
    del config["quantization_config"]
    assert Bridge.from_hf_config(config).dims.num_experts == 32
    assert layout_problems(config, tp=8, pp=4, ep=8, etp=1) == []
    assert layout_problems(config, tp=2, pp=1) == [
        "expert_tensor_parallel_size=2 with biased experts: Megatron-Core 0.16.1 needs "
        "expert_tensor_parallel_size=1 (set it; tensor parallelism stays on attention)"
    ]
