"""Layouts a model cannot take, read from its HF config alone, each naming both numbers."""

from __future__ import annotations

import pytest

from megatron_bridge.layout import layout_problems

LLAMA = {
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "hidden_size": 128,
}
MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}


def test_a_layout_that_fits_has_no_problems():
    assert layout_problems(LLAMA, tp=2, pp=2) == []
    assert layout_problems(MIXTRAL, tp=2, pp=1, ep=4) == []


def test_each_problem_names_both_numbers():
    assert layout_problems(LLAMA, tp=4, pp=1) == [
        "tensor_model_parallel_size=4 does not divide num_key_value_heads=2"
    ]
    assert layout_problems(LLAMA, tp=3, pp=3) == [
        "tensor_model_parallel_size=3 does not divide num_attention_heads=4",
        "tensor_model_parallel_size=3 does not divide num_key_value_heads=2",
        "pipeline_model_parallel_size × virtual=3 does not divide num_hidden_layers=2",
        "tensor_model_parallel_size=3 does not divide intermediate_size=256",
    ]
    assert layout_problems(LLAMA, tp=1, pp=1, ep=2) == [
        "expert_model_parallel_size=2 does not divide num_experts=0"
    ]
    assert layout_problems(MIXTRAL, tp=1, pp=1, ep=3) == [
        "expert_model_parallel_size=3 does not divide num_experts=4"
    ]


def test_kv_heads_default_to_the_attention_heads():
    config = {key: value for key, value in LLAMA.items() if key != "num_key_value_heads"}
    assert layout_problems(config, tp=4, pp=1) == []


def test_an_unknown_family_lists_the_supported_ones():
    with pytest.raises(
        KeyError, match=r"model_type='gpt2'; supported model types: deepseek_v3, llama, mixtral, qwen2"
    ):
        layout_problems({**LLAMA, "model_type": "gpt2"}, tp=1, pp=1)
