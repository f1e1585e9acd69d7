"""The builder turns each family's architecture facts into the TransformerConfig fields written out
here by hand, for every family's tiny preset (the models the tests and the quickstart build)."""

from __future__ import annotations

import pytest
import torch

from megatron_bridge.registry import family_types
from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.model_config import gpt_options, transformer_config_from_hf
from rltrain.models.tiny import tiny_hf_config

# The TransformerConfig fields that depend on the family (the rest is read from the HF config alike for
# all), and whether the actor's LM head is tied; one row per family's tiny preset.
FIELDS = (
    "add_qkv_bias",
    "qk_layernorm",
    "ffn_hidden_size",
    "num_moe_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_router_pre_softmax",
    "moe_aux_loss_coeff",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "tied",
)
# fmt: off
EXPECTED = {
    #             qkv_bias qk_norm  ffn  experts ffn   topk  pre_softmax  aux  shared gate   tied
    "llama":     (False,   False,   256, None,   None, 2,    False,       0.0,   None, False, False),
    "qwen2":     (True,    False,   256, None,   None, 2,    False,       0.0,   None, False, True),
    "qwen3":     (False,   True,    256, None,   None, 2,    False,       0.0,   None, False, True),
    "mixtral":   (False,   False,   128, 4,      128,  2,    False,       0.01,  None, False, False),
    "qwen2_moe": (True,    False,   256, 4,      128,  2,    True,        0.001, 128,  True,  False),
    "qwen3_moe": (False,   True,    256, 4,      128,  2,    False,       0.001, None, False, False),
    # qk_layernorm: MLA's latent norms (q_a_layernorm, kv_a_layernorm)
    "deepseek_v3": (False, True,    128, 4,      32,   2,    False,       0.0,   32,   False, False),
    "deepseek_v2": (False, True,    128, 6,      32,   2,    True,        0.0,   32,   False, False),
    "glm4_moe":  (True,    True,    256, 4,      64,   2,    False,       0.0,   64,   False, False),
    "gpt_oss":   (True,    False,   128, 4,      128,  2,    False,       0.01,  None, False, False),
}
# fmt: on


def test_every_family_has_expectations() -> None:
    assert sorted(EXPECTED) == family_types()


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_family_facts_reach_the_transformer_config(model_type: str) -> None:
    hf = tiny_hf_config(model_type, vocab_size=448)
    config = transformer_config_from_hf(hf, parallel=ParallelConfig(), params_dtype=torch.float32)
    *expected, tied = EXPECTED[model_type]
    assert {name: getattr(config, name) for name in FIELDS[:-1]} == dict(zip(FIELDS[:-1], expected))
    # layers, hidden, query groups, kv_channels (hidden / heads): the tiny presets' sizes; DeepSeek-V3's
    # has 4 layers (2 dense + 2 MoE) of 64 with 4 heads, no GQA (MLA's own head dims are checked below),
    # DeepSeek-V2's 3 (1 dense + 2 MoE), GLM-4.5's 3 (1 dense + 2 MoE)
    shapes = {"deepseek_v3": (4, 64, 4, 16), "deepseek_v2": (3, 64, 4, 16), "glm4_moe": (3, 128, 2, 32)}
    shape = shapes.get(model_type, (2, 128, 2, 32))
    assert (config.num_layers, config.hidden_size, config.num_query_groups, config.kv_channels) == shape
    assert gpt_options(hf, role="actor").tie_word_embeddings is tied
    assert gpt_options(hf, role="critic").tie_word_embeddings is False


def test_dense_layers_between_moe_layers_are_refused_naming_them() -> None:
    hf = tiny_hf_config("qwen2_moe", vocab_size=448, num_hidden_layers=4, decoder_sparse_step=2)
    with pytest.raises(NotImplementedError, match=r"qwen2_moe: dense layers .* not supported \(\[0, 2\]\)"):
        transformer_config_from_hf(hf, parallel=ParallelConfig(), params_dtype=torch.float32)


def test_sliding_window_layers_become_megatron_window_attention() -> None:
    """HF's window of w keys (itself included) is Megatron's window_size=(w - 1, 0), on the layers
    Megatron's own is_layer_window_attention (1-based layer numbers) picks from the skip pattern."""
    from megatron.core.transformer.utils import is_layer_window_attention

    hf = tiny_hf_config(
        "qwen2",
        vocab_size=448,
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=5,
        max_window_layers=1,
    )
    config = transformer_config_from_hf(hf, parallel=ParallelConfig(), params_dtype=torch.float32)
    assert config.window_size == (4, 0)
    windowed = [
        is_layer_window_attention(config.window_size, config.window_attn_skip_freq, n) for n in (1, 2, 3)
    ]
    assert windowed == [False, True, True]
    plain = transformer_config_from_hf(
        tiny_hf_config("qwen2", vocab_size=448, sliding_window=5),
        parallel=ParallelConfig(),
        params_dtype=torch.float32,
    )  # use_sliding_window false: the window is not used (transformers ignores it too)
    assert plain.window_size is None


def test_sliding_window_under_context_parallelism_is_refused() -> None:
    hf = tiny_hf_config(
        "qwen3", vocab_size=448, use_sliding_window=True, sliding_window=5, max_window_layers=0
    )
    with pytest.raises(
        NotImplementedError, match=r"qwen3: sliding_window with parallel.context_parallel_size=2"
    ):
        transformer_config_from_hf(
            hf, parallel=ParallelConfig(context_parallel_size=2), params_dtype=torch.float32
        )


@pytest.mark.parametrize("name", ["gemma-3-1b-it"])
def test_refused_families_are_refused_by_the_trainer_in_one_line(name: str) -> None:
    from transformers import CONFIG_MAPPING

    from megatron_bridge.refused import REFUSED
    from tests.released import shrunk_config

    config = shrunk_config(name)
    hf = CONFIG_MAPPING[config["model_type"]].from_dict(config)
    with pytest.raises(NotImplementedError) as err:
        transformer_config_from_hf(hf, parallel=ParallelConfig(), params_dtype=torch.float32)
    assert err.value.args == (REFUSED[config["model_type"]],)


def test_unsupported_model_type_lists_the_families() -> None:
    from transformers import GPTNeoXConfig

    with pytest.raises(
        NotImplementedError,
        match=r"gpt_neox.*supported: deepseek_v2, deepseek_v3, glm4_moe, gpt_oss, kimi_k2, llama, mixtral, qwen2, qwen2_moe",
    ):
        transformer_config_from_hf(GPTNeoXConfig(), parallel=ParallelConfig(), params_dtype=torch.float32)


def test_deepseek_v3_translates_to_mla_and_a_per_layer_moe_pattern() -> None:
    hf = tiny_hf_config("deepseek_v3", vocab_size=448)
    config = transformer_config_from_hf(hf, parallel=ParallelConfig(), params_dtype=torch.float32)
    assert config.multi_latent_attention and config.qk_layernorm
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim) == (32, 32, 32)
    assert (config.qk_pos_emb_head_dim, config.v_head_dim, config.rope_type) == (16, 32, "rope")
    assert config.moe_layer_freq == [0, 0, 1, 1] and config.ffn_hidden_size == 128
    assert (config.num_moe_experts, config.moe_ffn_hidden_size, config.moe_router_topk) == (4, 32, 2)
    assert config.moe_shared_expert_intermediate_size == 32 and not config.moe_shared_expert_gate
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)
    assert config.moe_router_topk_scaling_factor == 2.5
    assert config.moe_router_load_balancing_type == "none"
    yarn = tiny_hf_config(
        "deepseek_v3",
        vocab_size=448,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    )
    # YaRN reaches MLA's own rotary embedding (tests/unit/megatron/test_yarn.py has every branch).
    config = transformer_config_from_hf(yarn, parallel=ParallelConfig(), params_dtype=torch.float32)
    assert (config.rope_type, config.rotary_scaling_factor, config.original_max_position_embeddings) == (
        "yarn",
        4.0,
        128,
    )
    linear = tiny_hf_config(
        "deepseek_v3",
        vocab_size=448,
        rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    )
    with pytest.raises(
        NotImplementedError, match=r"deepseek_v3: rope_parameters.rope_type='linear' with multi-latent"
    ):
        transformer_config_from_hf(linear, parallel=ParallelConfig(), params_dtype=torch.float32)


def test_glm4_moe_and_kimi_k2_translate_to_partial_rope_and_ungrouped_sigmoid_routers() -> None:
    """GLM-4.5 (tiny preset): RoPE on half of each 32-dim head, layer 0 dense, sigmoid top-2 with the
    expert bias in one group, which is Megatron's ungrouped router; Kimi-K2's released config the same router over 16 experts, top-8, scaled by 2.827."""
    from transformers import DeepseekV3Config

    from tests.released import shrunk_config

    hf = tiny_hf_config("glm4_moe", vocab_size=448)
    config = transformer_config_from_hf(hf, parallel=ParallelConfig(), params_dtype=torch.float32)
    assert gpt_options(hf, role="actor").rotary_percent == 0.5 and not config.rotary_interleaved
    assert config.moe_layer_freq == [0, 1, 1] and config.kv_channels == 32
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (None, None)
    assert config.moe_router_topk_scaling_factor == 2.5 and not config.moe_router_pre_softmax
    assert gpt_options(tiny_hf_config("qwen3", vocab_size=448), role="actor").rotary_percent == 1.0

    kimi = shrunk_config("kimi-k2-instruct")
    del kimi["model_type"]  # kimi_k2: read by transformers' DeepseekV3Config (load_hf_config)
    config = transformer_config_from_hf(
        DeepseekV3Config.from_dict(kimi), parallel=ParallelConfig(), params_dtype=torch.float32
    )
    assert config.multi_latent_attention and config.moe_layer_freq == [0, 1, 1, 1]
    assert (config.num_moe_experts, config.moe_router_topk) == (16, 8)
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (None, None)
    assert config.moe_router_topk_scaling_factor == 2.827 and config.moe_router_enable_expert_bias


def test_gpt_oss_translates_to_biases_sinks_clamped_glu_windows_and_yarn() -> None:
    """GPT-OSS-20B's released config (shrunk; its MXFP4 quantization_config refused, then left out as a
    dequantized copy has it): biases on every linear (router too), learnable sinks, the clamped GLU
    (quick_gelu, offset 1, clamp 7), layer 0 sliding over 8 keys and layer 1 full, YaRN with
    truncate false; biased experts need expert_tensor_parallel_size=1."""
    from transformers import GptOssConfig

    from rltrain.megatron.model_config import quick_gelu
    from tests.released import shrunk_config

    config = shrunk_config("gpt-oss-20b")
    with pytest.raises(NotImplementedError, match=r"^gpt_oss: quantization_config.quant_method='mxfp4'"):
        transformer_config_from_hf(
            GptOssConfig.from_dict(config), parallel=ParallelConfig(), params_dtype=torch.float32
        )
    del config["quantization_config"]
    hf = GptOssConfig.from_dict(config)
    built = transformer_config_from_hf(hf, parallel=ParallelConfig(), params_dtype=torch.float32)
    assert built.add_bias_linear and built.add_qkv_bias and built.softmax_type == "learnable"
    assert built.activation_func is quick_gelu and built.gated_linear_unit
    assert (built.glu_linear_offset, built.activation_func_clamp_value) == (1.0, 7.0)
    assert built.window_size == (7, 0) and built.window_attn_skip_freq == [1, 0]
    assert (built.num_moe_experts, built.moe_router_topk, built.moe_router_pre_softmax) == (4, 2, False)
    assert built.moe_router_score_function == "softmax" and built.moe_aux_loss_coeff == 0.9
    assert (built.yarn_rotary_scaling_factor, built.yarn_original_max_position_embeddings) == (32.0, 16)
    assert built.yarn_correction_range_round_to_int is False  # truncate: false
    assert gpt_options(hf, role="actor").position_embedding_type == "yarn"
    x = torch.linspace(-9, 9, 37)
    assert torch.equal(quick_gelu(x), x * torch.sigmoid(x * 1.702))  # transformers' gate, alpha 1.702
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_size=2 with biased experts"):
        transformer_config_from_hf(
            hf, parallel=ParallelConfig(tensor_model_parallel_size=2), params_dtype=torch.float32
        )
