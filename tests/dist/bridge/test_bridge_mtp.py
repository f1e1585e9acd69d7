"""Multi-token-prediction layers (DeepSeek-V3's ``num_nextn_predict_layers: 1``) through conversion on
gloo ranks: every MTP tensor, and the MTP layer's own copies of the embedding and LM head, come back
bit-exact at TP=2 × PP=2 × EP=2 (the layer sits on the last stage, its experts split over EP)."""

from __future__ import annotations

import json
import re

import bridge_ranks
import pytest
import torch

from megatron_bridge.hf_io import HFCheckpointReader
from rltrain.convert import launch
from rltrain.convert.launch import run_conversion
from rltrain.convert.report import ConversionError
from rltrain.models.tiny import add_mtp_layers, randomize_expert_bias, save_tiny_model

pytestmark = pytest.mark.dist


@pytest.mark.supports("deepseek_v3", "mtp", "conversion", "tp", "pp", "ep")
def test_mtp_layer_round_trips_bit_exact_at_tp2_pp2_ep2(tmp_path):
    src = save_tiny_model(tmp_path / "hf", "deepseek_v3", seed=1, num_mtp_layers=1)
    randomize_expert_bias(src)
    added = add_mtp_layers(src)
    assert (
        "model.layers.4.eh_proj.weight" in added and "model.layers.4.mlp.experts.3.down_proj.weight" in added
    )
    to_mcore = run_conversion("hf-to-mcore", src, tmp_path / "mcore", tp=2, pp=2, ep=2, atol=1e-4)
    source = HFCheckpointReader(src)
    assert to_mcore.bit_exact_tensors == len(source.names())
    assert to_mcore.max_abs_logit_diff <= 1e-5  # the main model vs transformers, fp32
    print(to_mcore.summary())
    # the MTP layer (on the last stage, experts over EP) vs transformers' MtpModel, fp32
    assert len(to_mcore.max_abs_mtp_logit_diffs) == 1 and to_mcore.max_abs_mtp_logit_diffs[0] <= 1e-5
    back = run_conversion("mcore-to-hf", tmp_path / "mcore", tmp_path / "back", tp=2, pp=2, ep=2, atol=1e-4)
    assert back.max_abs_logit_diff <= 1e-5
    assert back.max_abs_mtp_logit_diffs[0] <= 1e-5
    result = HFCheckpointReader(tmp_path / "back")
    assert sorted(result.names()) == sorted(source.names())
    for name in source.names():
        assert torch.equal(result.get(name), source.get(name)), name
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """A tiny DeepSeek-V3 with one MTP layer, weights large enough (std 0.1) that a planted swap
    moves the MTP logits far beyond fp32 rounding."""
    src = save_tiny_model(
        tmp_path_factory.mktemp("mtp") / "hf", "deepseek_v3", init_std=0.1, num_mtp_layers=1
    )
    add_mtp_layers(src, std=0.1)
    return src


@pytest.mark.parametrize("entry", ["entry_with_mtp_norms_swapped", "entry_with_mtp_experts_swapped"])
def test_a_swap_in_the_mtp_layer_fails_verification(tmp_path, monkeypatch, mtp_checkpoint, entry):
    monkeypatch.setattr(launch, "_entry", getattr(bridge_ranks, entry))
    with pytest.raises(ConversionError) as failed:
        run_conversion("hf-to-mcore", mtp_checkpoint, tmp_path / "mcore", ep=2)
    found = re.search(
        r"MTP layer 0 logits vs transformers.*max abs diff (\S+) > tolerance (\S+)", str(failed.value)
    )
    assert found, str(failed.value)
    assert float(found.group(1)) > 3 * float(found.group(2))
    assert not (tmp_path / "mcore").exists()


def test_an_export_dropping_the_mtp_layer_fails_verification(tmp_path, monkeypatch, mtp_checkpoint):
    run_conversion("hf-to-mcore", mtp_checkpoint, tmp_path / "mcore", verify=False)
    monkeypatch.setattr(launch, "_entry", bridge_ranks.entry_dropping_mtp_on_export)
    with pytest.raises(ConversionError, match=r"missing tensors \['model\.layers\.4\."):
        run_conversion("mcore-to-hf", tmp_path / "mcore", tmp_path / "back", atol=None)
    assert not (tmp_path / "back").exists()


def test_a_checkpoint_without_its_mtp_tensors_is_refused_naming_them(tmp_path):
    src = save_tiny_model(
        tmp_path / "hf", "deepseek_v3", num_mtp_layers=1
    )  # transformers writes no MTP layer
    with pytest.raises(ConversionError, match=r"missing tensors \['model\.layers\.4\.e"):
        run_conversion("hf-to-mcore", src, tmp_path / "mcore")
