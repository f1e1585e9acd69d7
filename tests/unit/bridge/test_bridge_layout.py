"""Layouts a model cannot take, read from its HF config alone, each naming both numbers."""

from __future__ import annotations

import pytest
import torch

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
        "tensor_model_parallel_size=3 does not divide intermediate_size=256",
        "pipeline_model_parallel_size × virtual=3 does not divide num_hidden_layers=2"
        " (set num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage for uneven stages)",
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
        KeyError,
        match=r"model_type='gpt2'; supported model types: deepseek_v2, deepseek_v3, glm4_moe, gpt_oss, kimi_k2, llama, mixtral, qwen2",
    ):
        layout_problems({**LLAMA, "model_type": "gpt2"}, tp=1, pp=1)


UNEVEN_SPLITS = [
    # (num_layers, pp, vpp, first, last)
    (4, 2, 1, None, None),
    (5, 2, 1, 2, 3),
    (5, 2, 1, 2, None),
    (5, 2, 1, None, 1),
    (7, 3, 1, 1, 2),
    (8, 3, 1, 2, None),
    (12, 3, 2, 2, 2),
    (8, 2, 2, None, None),
]


@pytest.mark.parametrize(("num_layers", "pp", "vpp", "first", "last"), UNEVEN_SPLITS)
def test_chunk_layers_equal_megatron_core_offsets(num_layers, pp, vpp, first, last):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_bridge.layout import chunk_layers, stage_of_layer

    config = TransformerConfig(
        num_layers=num_layers, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
        pipeline_dtype=torch.float32,
    )  # fmt: skip
    owner = {}
    for rank in range(pp):
        for vp in range(vpp):
            vp_stage = vp if vpp > 1 else None
            ours = chunk_layers(num_layers, pp_rank=rank, pp=pp, vp_stage=vp, vpp=vpp, first=first, last=last)
            offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=rank)
            count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=rank)
            assert (ours.start, len(ours)) == (offset, count), (rank, vp)
            owner.update(dict.fromkeys(ours, rank))
    assert sorted(owner) == list(range(num_layers))  # every layer exactly on one chunk
    assert [stage_of_layer(i, num_layers, pp=pp, vpp=vpp, first=first, last=last) for i in owner] == [
        owner[i] for i in owner
    ]


def test_uneven_stages_that_do_not_add_up_name_the_keys():
    five = {**LLAMA, "num_hidden_layers": 5}
    assert layout_problems(five, tp=1, pp=2, first=2, last=3) == []
    assert layout_problems(five, tp=1, pp=2, first=2) == []
    assert layout_problems(five, tp=1, pp=2, first=2, last=2) == [
        "num_layers_in_first_pipeline_stage=2 + num_layers_in_last_pipeline_stage=2 leaves 1 of "
        "num_hidden_layers=5 for the 0 middle stage(s) of pipeline_model_parallel_size=2"
    ]
    assert layout_problems(five, tp=1, pp=4, first=1, last=1) == [
        "num_layers_in_first_pipeline_stage=1 + num_layers_in_last_pipeline_stage=1 leaves 3 of "
        "num_hidden_layers=5, which the 2 other stage(s) × virtual=1 do not divide"
    ]
    assert layout_problems(five, tp=1, pp=2, first=3, last=3) == [
        "num_layers_in_first_pipeline_stage=3 + num_layers_in_last_pipeline_stage=3 leaves -1 of "
        "num_hidden_layers=5 for the 0 middle stage(s) of pipeline_model_parallel_size=2"
    ]
    assert layout_problems(five, tp=1, pp=1, last=5) == [
        "num_layers_in_last_pipeline_stage=5 needs pipeline_model_parallel_size >= 2 (got 1)"
    ]
    assert layout_problems(five, tp=1, pp=2, vpp=2, first=1, last=4) == [
        "num_layers_in_first_pipeline_stage=1 is not a multiple of virtual_pipeline_model_parallel_size=2"
    ]
