"""YaRN translation: for each ``rope_type: yarn`` variant, the Megatron settings the builder gives
reproduce transformers' own numbers (inverse frequencies, cos/sin attention factor, MLA's softmax
scale: computed here by transformers and by Megatron-Core's YaRN functions from the built config),
and what Megatron-Core 0.16.1 cannot express is refused naming the key."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    YarnRotaryEmbedding,
    _yarn_get_concentration_factor,
    _yarn_get_concentration_factor_from_config,
    _yarn_get_mscale,
)
from transformers.modeling_rope_utils import _compute_yarn_parameters
from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.model_config import gpt_options, transformer_config_from_hf
from rltrain.megatron.yarn import YarnTransformerConfig
from rltrain.models.tiny import tiny_hf_config

CARD = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
"""Qwen3's model-card block, at a tiny original length."""

GQA_VARIANTS = {
    "card": CARD,
    "both mscales": {**CARD, "mscale": 2.0, "mscale_all_dim": 1.0},
    "mscale only (ignored by transformers)": {**CARD, "mscale": 3.0},
    "explicit attention factor equal to the derived one": {**CARD, "attention_factor": 0.1 * math.log(4) + 1},
    "betas and no rounding": {**CARD, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "betas zero mean the defaults": {**CARD, "beta_fast": 0, "beta_slow": 0},
    "factor none: the length ratio": {**CARD, "factor": None},
    "factor below one": {**CARD, "factor": 1.0},
}


@pytest.fixture(autouse=True)
def _cpu_device(monkeypatch):
    # YarnRotaryEmbedding moves its frequencies to torch.cuda.current_device() (the CPU run's
    # cpu_compat maps it to the CPU; here a monkeypatch does, for this module only).
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))


def _build(model_type: str, rope: dict, **overrides):
    hf = tiny_hf_config(
        model_type,
        vocab_size=448,
        max_position_embeddings=128,
        rope_parameters={"rope_theta": 1e6 if model_type == "qwen3" else 1e4, **rope},
        **overrides,
    )
    return hf, transformer_config_from_hf(hf, parallel=ParallelConfig(), params_dtype=torch.float32)


@pytest.mark.parametrize("variant", sorted(GQA_VARIANTS))
def test_grouped_query_yarn_gives_transformers_frequencies_and_attention_factor(variant: str) -> None:
    hf, config = _build("qwen3", GQA_VARIANTS[variant])
    assert isinstance(config, YarnTransformerConfig)
    assert gpt_options(hf, role="actor").position_embedding_type == "yarn"
    hf_inv_freq, hf_factor = _compute_yarn_parameters(hf)
    assert _yarn_get_concentration_factor_from_config(config) == pytest.approx(hf_factor, rel=1e-15)
    # GPTModel's rotary embedding, built from the config the way GPTModel builds it.
    rotary = YarnRotaryEmbedding(
        kv_channels=config.kv_channels,
        rotary_base=gpt_options(hf, role="actor").rotary_base,
        scaling_factor=config.yarn_rotary_scaling_factor,
        original_max_position_embeddings=config.yarn_original_max_position_embeddings,
        beta_fast=config.yarn_beta_fast,
        beta_slow=config.yarn_beta_slow,
        mscale=config.yarn_mscale,
        mscale_all_dim=config.yarn_mscale_all_dim,
        correction_range_round_to_int=config.yarn_correction_range_round_to_int,
        use_cpu_initialization=True,
    )
    emb, _ = rotary.get_emb(64)
    positions = torch.arange(64, dtype=torch.float32)
    assert torch.equal(emb[:, 0, 0, : config.kv_channels // 2], torch.outer(positions, hf_inv_freq))


def test_the_card_block_gives_these_fields() -> None:
    _, config = _build("qwen3", CARD)
    assert {name: getattr(config, name) for name in sorted(vars(config)) if name.startswith("yarn_")} == {
        "yarn_beta_fast": 32.0,
        "yarn_beta_slow": 1.0,
        "yarn_correction_range_round_to_int": True,
        "yarn_mscale": 1.0,
        "yarn_mscale_all_dim": 0.0,
        "yarn_original_max_position_embeddings": 16,
        "yarn_rotary_scaling_factor": 4.0,
    }
    assert _yarn_get_concentration_factor_from_config(config) == pytest.approx(1 + 0.1 * math.log(4))


MLA_VARIANTS = {
    "as released (DeepSeek-V3)": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "mscale 0.707 (DeepSeek-V2)": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 16,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "different mscales": {**CARD, "mscale": 2.0, "mscale_all_dim": 0.5},
    "no mscales": CARD,
    "mscale without mscale_all_dim": {**CARD, "mscale": 2.0},
}


@pytest.mark.parametrize("variant", sorted(MLA_VARIANTS))
def test_mla_yarn_gives_transformers_attention_factor_and_softmax_scale(variant: str) -> None:
    hf, config = _build("deepseek_v3", MLA_VARIANTS[variant])
    assert config.rope_type == "yarn" and gpt_options(hf, role="actor").position_embedding_type == "rope"
    hf_inv_freq, hf_factor = _compute_yarn_parameters(hf)
    ours = _yarn_get_concentration_factor(config.rotary_scaling_factor, config.mscale, config.mscale_all_dim)
    assert ours == pytest.approx(hf_factor, rel=1e-15)
    q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
    megatron_scale = _yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim) ** 2 / math.sqrt(
        q_head_dim
    )
    assert megatron_scale == pytest.approx(yarn_apply_mscale(hf.rope_parameters, q_head_dim**-0.5), rel=1e-15)
    rotary = YarnRotaryEmbedding(
        config.qk_pos_emb_head_dim,
        rotary_base=config.rotary_base,
        scaling_factor=config.rotary_scaling_factor,
        original_max_position_embeddings=config.original_max_position_embeddings,
        beta_fast=config.beta_fast,
        beta_slow=config.beta_slow,
        mscale=config.mscale,
        mscale_all_dim=config.mscale_all_dim,
        use_cpu_initialization=True,
    )
    emb, _ = rotary.get_emb(64)
    positions = torch.arange(64, dtype=torch.float32)
    assert torch.equal(emb[:, 0, 0, : config.qk_pos_emb_head_dim // 2], torch.outer(positions, hf_inv_freq))


@pytest.mark.parametrize(
    ("model_type", "rope", "message"),
    [
        (
            "qwen3",
            {**CARD, "attention_factor": 1.0},
            r"qwen3: rope_parameters.attention_factor=1.0 differs from the 1.138.* that Megatron-Core 0.16.1 derives",
        ),
        (
            "deepseek_v3",
            {**CARD, "truncate": False},
            r"deepseek_v3: rope_parameters.truncate=false with multi-latent attention",
        ),
        (
            "deepseek_v3",
            {**CARD, "mscale_all_dim": 1.0},
            r"deepseek_v3: rope_parameters.mscale=None with mscale_all_dim=1.0 and multi-latent attention",
        ),
    ],
)
def test_what_megatron_cannot_express_is_refused_naming_the_key(
    model_type: str, rope: dict, message: str
) -> None:
    with pytest.raises(NotImplementedError, match=message):
        _build(model_type, rope)
    hf = tiny_hf_config(model_type, vocab_size=448, rope_parameters={"rope_theta": 1e4, **rope})
    with pytest.raises(NotImplementedError, match=message):
        gpt_options(hf, role="actor")


def test_partial_rotary_yarn_is_refused_for_grouped_query_attention() -> None:
    rope = {**CARD, "partial_rotary_factor": 0.5}
    with pytest.raises(
        NotImplementedError, match=r"qwen3: rope_parameters.partial_rotary_factor=0.5 with YaRN"
    ):
        _build("qwen3", rope)


def test_yarn_with_context_parallelism_is_refused_without_cuda() -> None:
    # Megatron's YarnRotaryEmbedding slices its cos/sin cache per CP rank in its constructor with
    # pin_memory=True: "RuntimeError: pin_memory=True requires a CUDA or other accelerator backend".
    hf = tiny_hf_config("qwen3", vocab_size=448, rope_parameters={"rope_theta": 1e6, **CARD})
    with pytest.raises(
        NotImplementedError,
        match=r"qwen3: rope_parameters.rope_type='yarn' with parallel.context_parallel_size=2 needs CUDA",
    ):
        transformer_config_from_hf(
            hf, parallel=ParallelConfig(context_parallel_size=2), params_dtype=torch.float32
        )
