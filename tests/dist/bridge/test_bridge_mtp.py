"""Multi-token-prediction layers (DeepSeek-V3's ``num_nextn_predict_layers: 1``) through conversion on
gloo ranks: every MTP tensor, and the MTP layer's own copies of the embedding and LM head, come back
bit-exact at TP=2 × PP=2 × EP=2 (the layer sits on the last stage, its experts split over EP)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_bridge.hf_io import HFCheckpointReader
from rltrain.convert.launch import run_conversion
from rltrain.models.tiny import add_mtp_layers, randomize_expert_bias, save_tiny_model

pytestmark = pytest.mark.dist


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
    back = run_conversion("mcore-to-hf", tmp_path / "mcore", tmp_path / "back", tp=2, pp=2, ep=2, atol=1e-4)
    assert back.max_abs_logit_diff <= 1e-5
    result = HFCheckpointReader(tmp_path / "back")
    assert sorted(result.names()) == sorted(source.names())
    for name in source.names():
        assert torch.equal(result.get(name), source.get(name)), name
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1
