"""GPT-OSS-20B (its released config.json, shrunk: ``tests/released/gpt-oss-20b``; unquantized, as a
dequantized copy is) through ``rltrain convert`` with the attention split over TP=2 and the experts
over EP=2 (expert-TP 1: Megatron-Core's biased experts need it): Megatron's fp32 logits equal
transformers' on the probe (256 tokens: past the 8-key window and the 16-position YaRN length), the
checkpoint comes back bit for bit, and the default verification fails for three table bugs the
round trip cannot see."""

from __future__ import annotations

import bridge_ranks
import pytest
import torch
from dist_harness import run_ranks

from megatron_bridge.hf_io import HFCheckpointReader
from rltrain.convert.launch import run_conversion
from rltrain.models.tiny import randomize_all_weights
from tests.released import save_released_model

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def gpt_oss_checkpoint(tmp_path_factory):
    """The tiny GPT-OSS with every tensor random and large enough to matter: transformers initializes
    the expert biases to zero and the sinks near it; here biases and sinks ~ N(0, 0.5), norms in
    [0.5, 1.5), matrices ~ N(0, 0.15), ``gate_up_proj`` ~ N(0, 0.3) (some values past the clamp at 7)."""
    src = save_released_model(tmp_path_factory.mktemp("gpt_oss") / "hf", "gpt-oss-20b", seed=1)
    randomize_all_weights(src, seed=4, stds={"gate_up_proj": 0.3})
    return src


@pytest.mark.supports("gpt_oss", "conversion", "tp", "ep")
def test_gpt_oss_converts_bit_exact_at_tp2_ep2_and_matches_transformers(tmp_path, gpt_oss_checkpoint):
    src = gpt_oss_checkpoint
    to_mcore = run_conversion("hf-to-mcore", src, tmp_path / "mcore", tp=2, ep=2, etp=1, atol=1e-4)
    print(to_mcore.summary())
    names = HFCheckpointReader(src).names()
    assert to_mcore.bit_exact_tensors == len(names) == 37
    assert to_mcore.max_abs_logit_diff <= 1e-5  # Megatron at TP=2 × EP=2 vs transformers, fp32
    run_conversion("mcore-to-hf", tmp_path / "mcore", tmp_path / "back", verify=False)
    back, reader = HFCheckpointReader(tmp_path / "back"), HFCheckpointReader(src)
    assert sorted(back.names()) == sorted(names)
    for tensor in names:
        assert torch.equal(reader.get(tensor), back.get(tensor)), tensor
    assert (tmp_path / "back" / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_the_verification_fails_for_swapped_gate_up_an_untransposed_expert_or_dropped_sinks(
    gpt_oss_checkpoint,
):
    (results,) = run_ranks(bridge_ranks.gpt_oss_mutation_checks, 1, str(gpt_oss_checkpoint))
    print(results)
    diff, tolerance = results.pop("as saved")
    assert diff <= tolerance
    for variant, (diff, tolerance) in results.items():
        assert diff > 10 * tolerance, (variant, diff, tolerance)
