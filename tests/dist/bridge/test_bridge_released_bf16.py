"""The released configs' tiny models in bf16, saved as transformers saves a bf16 checkpoint (the
expert-choice bias kept in fp32), convert with the default verification: every tensor bit-exact
with its own dtype through the round trip, and the logits (and MTP logits) against transformers
within the stated bf16 tolerance, ``atol`` plus three times what bf16 rounding alone moves
transformers' own logits, recomputed here from transformers directly (issue #35 §4's dtype
tolerance), a routed model's near-tie expert flips aside (at most 1% of the probe's tokens,
``ROUTING_FLIP_FRACTION``: GLM-4.5-Air's model here has one). One rank process converts them all."""

from __future__ import annotations

import re

import bridge_ranks
import pytest
import torch
from dist_harness import run_ranks

from megatron_bridge.hf_config import load_hf_config
from megatron_bridge.verify import ROUNDING_NOISE_FACTOR, hf_logits, probe_batch, probe_tokens

pytestmark = pytest.mark.dist

NAMES = (
    "deepseek-v3",
    "kimi-k2-instruct",
    "moonlight-16b-a3b-instruct",
    "glm-4.5-air",
    "qwen3-8b-yarn",
    "gpt-oss-20b",
)
FP32_KEPT = {"deepseek-v3", "kimi-k2-instruct", "moonlight-16b-a3b-instruct", "glm-4.5-air"}
"""Configs whose transformers class keeps ``e_score_correction_bias`` in fp32 in a bf16 checkpoint."""


@pytest.fixture(scope="module")
def conversions(tmp_path_factory):
    (result,) = run_ranks(
        bridge_ranks.released_bf16_conversions, 1, str(tmp_path_factory.mktemp("bf16")), NAMES
    )
    return result


@pytest.mark.supports("deepseek_v3", "conversion", "mtp", "yarn")
@pytest.mark.supports("glm4_moe", "conversion", "mtp")
@pytest.mark.supports("qwen3", "conversion", "yarn")
@pytest.mark.supports("gpt_oss", "conversion", "yarn", "sliding_window")
@pytest.mark.parametrize("name", NAMES)
def test_a_bf16_released_checkpoint_converts_and_verifies_within_the_stated_tolerance(conversions, name):
    case = conversions[name]
    report, dtypes = case["report"], case["dtypes"]
    assert report["bit_exact_tensors"] == len(dtypes)
    bias = {key: dtype for key, dtype in dtypes.items() if key.endswith("e_score_correction_bias")}
    others = {dtype for key, dtype in dtypes.items() if key not in bias}
    assert others == {"BF16"}
    assert set(bias.values()) == ({"F32"} if name in FP32_KEPT else set())
    config = load_hf_config(case["src"])
    ids = probe_batch(config.vocab_size, seq=probe_tokens(config))  # the rows the conversion probed
    noise = (
        (hf_logits(case["src"], ids, dtype=torch.bfloat16) - hf_logits(case["src"], ids)).abs().max().item()
    )
    assert noise > 1e-3  # bf16 rounding alone moves the logits far beyond fp32's atol
    assert report["logits_tolerance"] == pytest.approx(1e-4 + ROUNDING_NOISE_FACTOR * noise)
    assert report["max_abs_logit_diff"] > 0 and "both in bfloat16" in report["logits_check"]
    if report["max_abs_logit_diff"] > report["logits_tolerance"]:  # a routed model's flipped tokens
        beyond = re.search(r"; (\d+) of 512 tokens beyond it, at most 6 allowed", report["logits_check"])
        assert name in FP32_KEPT and beyond and 1 <= int(beyond[1]) <= 6, report["logits_check"]
    mtp_layers = getattr(config, "num_nextn_predict_layers", 0) or 0
    assert len(report["mtp_logits_checks"]) == mtp_layers
    for check in report["mtp_logits_checks"]:
        assert "both in bfloat16" in check and "<= tolerance" in check
