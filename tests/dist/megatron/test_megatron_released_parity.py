"""The actor built from a released config (``tests/released``: GLM-4.5-Air, Kimi-K2-Instruct, shrunk)
computes the log-probs and entropies transformers computes on the same weights, fp32."""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from released_cases import CASES, gpt_oss_case, released_parity_case

pytestmark = pytest.mark.dist


@pytest.mark.supports("glm4_moe", "hf_parity")
def test_released_configs_logprobs_match_transformers(tmp_path) -> None:
    (result,) = run_ranks(released_parity_case, 1, str(tmp_path))
    print(result)
    for name in CASES:
        assert result[f"{name}_scale"] > 1.0
        for field in ("logprobs", "entropy"):
            assert result[f"{name}_{field}"] < 1e-5, f"{name} {field}: {result[f'{name}_{field}']:.3g}"


@pytest.mark.supports("gpt_oss", "hf_parity", "sliding_window", "yarn")
def test_gpt_oss_logprobs_match_transformers_past_its_window_and_yarn_length(tmp_path) -> None:
    """GPT-OSS-20B's released config (shrunk: 8-key windows on layer 0, YaRN pre-trained on 16 of 512
    positions): rows of up to 48 tokens, longer than the window and past the YaRN length, packed, with
    random sinks, attention/router/expert biases and expert weights large enough that the GLU clamps
    some gate and up values. Then one training step's gradients of the sinks and the router and expert
    biases against transformers' (Megatron's routing-weighted expert bias, the sinks' backward)."""
    (result,) = run_ranks(gpt_oss_case, 1, str(tmp_path))
    print(result)
    assert result["gpt-oss-20b_scale"] > 1.0
    for field in ("logprobs", "entropy"):
        assert result[f"gpt-oss-20b_{field}"] < 1e-5, f"{field}: {result[f'gpt-oss-20b_{field}']:.3g}"
    # the training step's gradients: transformers' to fp32 rounding (measured 1.5e-7 to 4.2e-7 relative)
    for kind in ("sinks", "router_bias", "down_bias", "gate_up_bias"):
        assert result[f"grad_{kind}_scale"] > 1e-4 and result[f"grad_{kind}"] < 1e-4, (kind, result)
