"""Multi-token-prediction layers in the bridge: HF decoder layer ``num_hidden_layers + i`` ↔ Megatron-Core's
``mtp.layers.i``; the layer's own embedding and head copies are checked on import and written back."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_bridge.bridge import Bridge
from megatron_bridge.naming import ChunkNaming
from megatron_bridge.sharding import RankPosition, holds
from rltrain.models.tiny import add_mtp_layers, save_tiny_model

MTP_EXTRAS = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}
COPIES = {"embed_tokens.weight", "shared_head.head.weight"}


@pytest.fixture(scope="module")
def mtp_state(tmp_path_factory):
    src = save_tiny_model(tmp_path_factory.mktemp("mtp") / "hf", "deepseek_v3", seed=3, num_mtp_layers=1)
    added = add_mtp_layers(src)
    return json.loads((src / "config.json").read_text()), load_file(src / "model.safetensors"), added


def test_the_mtp_layer_is_the_last_decoder_layer_plus_its_own_tensors(mtp_state):
    config, state, added = mtp_state
    bridge = Bridge.from_hf_config(config)
    assert config["num_hidden_layers"] == 4 and bridge.num_mtp_layers == 1
    # by hand: layer 3's (a MoE layer's) names at index 4, and the MTP layer's own six
    last = {n.removeprefix("model.layers.3.") for n in state if n.startswith("model.layers.3.")}
    expected = {f"model.layers.4.{rest}" for rest in last | MTP_EXTRAS | COPIES}
    assert {n for n in bridge.hf_names() if n.startswith("model.layers.4.")} == expected
    assert sorted(added) == sorted(expected) and set(bridge.hf_names()) == set(state)
    megatron = [n for n in bridge.megatron_names() if n.startswith("mtp.")]
    # gate and up fuse into one linear_fc1 for each of the 4 experts and the shared expert
    assert len(megatron) == len(expected) - len(COPIES) - 5
    assert "mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc2.weight" in megatron
    assert "mtp.layers.0.eh_proj.weight" in megatron and "mtp.layers.0.final_layernorm.weight" in megatron


def test_hf_to_megatron_and_back_is_bit_exact_with_the_copies(mtp_state):
    config, state, _ = mtp_state
    bridge = Bridge.from_hf_config(config)
    megatron = bridge.hf_to_megatron(state)
    assert torch.equal(megatron["mtp.layers.0.enorm.weight"], state["model.layers.4.enorm.weight"])
    assert torch.equal(megatron["mtp.layers.0.hnorm.weight"], state["model.layers.4.hnorm.weight"])
    assert torch.equal(
        megatron["mtp.layers.0.transformer_layer.mlp.experts.local_experts.1.linear_fc1.weight"],
        torch.cat(
            [
                state["model.layers.4.mlp.experts.1.gate_proj.weight"],
                state["model.layers.4.mlp.experts.1.up_proj.weight"],
            ]
        ),
    )
    back = bridge.megatron_to_hf(megatron)
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_an_mtp_copy_that_differs_from_the_main_tensor_is_refused_naming_it(mtp_state):
    config, state, _ = mtp_state
    changed = {**state, "model.layers.4.shared_head.head.weight": state["lm_head.weight"] + 1e-6}
    with pytest.raises(
        ValueError, match=r"model\.layers\.4\.shared_head\.head\.weight differs from lm_head\.weight"
    ):
        Bridge.from_hf_config(config).hf_to_megatron(changed)


def test_a_checkpoint_missing_the_mtp_layer_is_refused_naming_the_tensors(mtp_state):
    config, state, _ = mtp_state
    dropped = {n: t for n, t in state.items() if not n.startswith("model.layers.4.e")}
    with pytest.raises(
        KeyError,
        match=r"missing tensors \['model\.layers\.4\.eh_proj\.weight', 'model\.layers\.4\.embed_tokens",
    ):
        Bridge.from_hf_config(config).hf_to_megatron(dropped)


def test_without_num_nextn_predict_layers_there_is_no_mtp_layer(mtp_state):
    config, _, _ = mtp_state
    bridge = Bridge.from_hf_config({**config, "num_nextn_predict_layers": 0})
    assert not [n for n in bridge.hf_names() if n.startswith("model.layers.4.")]
    # transformers' DeepseekV3Config default is one MTP layer: a config.json leaving the key out has it
    left_out = {k: v for k, v in config.items() if k != "num_nextn_predict_layers"}
    assert Bridge.from_hf_config(left_out).num_mtp_layers == 1
    assert Bridge.from_hf_config(config, head="score").num_mtp_layers == 0  # a reward model: no MTP


def test_mtp_layers_the_bridge_cannot_build_are_refused_naming_the_key(mtp_state):
    config, _, _ = mtp_state
    with pytest.raises(
        NotImplementedError, match="num_nextn_predict_layers=1 with a dense last decoder layer"
    ):
        Bridge.from_hf_config({**config, "first_k_dense_replace": 4})
    v2 = {**config, "model_type": "deepseek_v2", "topk_method": "greedy", "scoring_func": "softmax"}
    with pytest.raises(
        NotImplementedError, match="deepseek_v2: num_nextn_predict_layers=1, but the bridge has no"
    ):
        Bridge.from_hf_config(v2)


def test_chunk_naming_offsets_the_experts_of_an_mtp_layer_not_its_index():
    naming = ChunkNaming(layer_offset=2, expert_offset=2, num_local_experts=2, moe=True)
    local = "mtp.layers.0.transformer_layer.mlp.experts.local_experts.1.linear_fc1.weight"
    canonical = "mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc1.weight"
    assert naming.to_canonical(local) == canonical and naming.from_canonical(canonical) == local
    assert naming.to_canonical("mtp.layers.0.enorm.weight") == "mtp.layers.0.enorm.weight"
    assert naming.owns_expert(canonical) and not naming.owns_expert(canonical.replace(".3.", ".1."))


def test_the_mtp_layer_lives_on_the_last_stage_its_experts_split_over_ep(mtp_state):
    config, _, _ = mtp_state
    bridge = Bridge.from_hf_config(config)
    expert = "mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc2.weight"
    at = {
        (pp, ep): RankPosition(pp_rank=pp, pp_size=2, ep_rank=ep, ep_size=2) for pp in (0, 1) for ep in (0, 1)
    }
    assert [holds(bridge, at[k], "mtp.layers.0.eh_proj.weight") for k in sorted(at)] == [
        False,
        False,
        True,
        True,
    ]
    assert [holds(bridge, at[k], expert) for k in sorted(at)] == [False, False, False, True]
