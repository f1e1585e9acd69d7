"""A layout that cannot split the model fails before anything is built, naming both numbers."""

from __future__ import annotations

import pytest
import torch
from megatron_fixtures import tiny_llama, tiny_mixtral

from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.model_config import gpt_options, padded_vocab_size, transformer_config_from_hf


def _config(hf, **parallel):
    return transformer_config_from_hf(hf, parallel=ParallelConfig(**parallel), params_dtype=torch.float32)


def test_tp_not_dividing_heads_names_both_numbers() -> None:
    with pytest.raises(
        ValueError, match=r"tensor_model_parallel_size=3 does not divide num_attention_heads=4"
    ):
        _config(tiny_llama(), tensor_model_parallel_size=3)


def test_ep_not_dividing_experts_names_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"expert_model_parallel_size=3 does not divide num_experts=4"):
        _config(tiny_mixtral(), expert_model_parallel_size=3)


def test_hf_fields_reach_the_transformer_config() -> None:
    hf = tiny_mixtral(rms_norm_eps=1e-5, rope_theta=5e5, tie_word_embeddings=True)
    config = _config(hf)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_aux_loss_coeff) == (4, 2, 0.01)
    assert (config.num_query_groups, config.layernorm_epsilon, config.gated_linear_unit) == (2, 1e-5, True)
    options = gpt_options(hf, role="actor")
    assert options.rotary_base == 5e5 and options.tie_word_embeddings
    assert not gpt_options(hf, role="critic").tie_word_embeddings


def test_qwen2_moe_uses_pre_softmax_routing_and_a_gated_shared_expert() -> None:
    from transformers import Qwen2MoeConfig

    hf = Qwen2MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    )
    config = _config(hf)
    assert config.moe_router_pre_softmax and config.add_qkv_bias
    assert (config.moe_shared_expert_intermediate_size, config.moe_shared_expert_gate) == (48, True)


def test_vocab_is_padded_to_a_multiple_of_tp() -> None:
    assert padded_vocab_size(255, tp_size=2) == 256
    assert padded_vocab_size(256, tp_size=2) == 256
    assert padded_vocab_size(49152, tp_size=8, divisible_by=128) == 49152
    assert padded_vocab_size(151_665, tp_size=4, divisible_by=128) == 152_064
