"""Family tables, registry and TP/PP/EP split-merge on real tiny HF checkpoints (bit-exact)."""

from __future__ import annotations

import pytest
import torch

from megatron_bridge.bridge import Bridge
from megatron_bridge.naming import ChunkNaming
from megatron_bridge.registry import family_types, get_family
from megatron_bridge.sharding import all_positions, merge_states, split_state

FAMILIES = tuple(family_types())


def _equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("model_type", FAMILIES)
def test_table_covers_exactly_the_checkpoint_and_round_trips(tiny_states, model_type):
    config, hf = tiny_states[model_type]
    bridge = Bridge.from_hf_config(config)
    assert sorted(bridge.hf_names()) == sorted(hf)
    megatron = bridge.hf_to_megatron(hf)
    assert megatron["embedding.word_embeddings.weight"].shape[0] == 512  # 393 padded to 128
    _equal_states(bridge.megatron_to_hf(megatron), hf)


@pytest.mark.parametrize(
    ("model_type", "tp", "pp", "ep"),
    [
        ("llama", 2, 2, 1),
        ("qwen2", 2, 2, 1),
        ("qwen3", 2, 1, 1),
        ("mixtral", 2, 2, 2),
        ("qwen2_moe", 2, 2, 2),
        ("qwen3_moe", 2, 2, 2),
    ],
)
@pytest.mark.parametrize("te_spec", [False, True])
def test_split_over_ranks_and_merge_is_bit_exact(tiny_states, model_type, tp, pp, ep, te_spec):
    config, hf = tiny_states[model_type]
    bridge = Bridge.from_hf_config(config, tp_size=tp)
    canonical = bridge.hf_to_megatron(hf)
    positions = all_positions(tp=tp, pp=pp, ep=ep)
    states = {
        pos: split_state(bridge, canonical, pos, te_spec=te_spec, grouped_gemm=te_spec) for pos in positions
    }
    merged = merge_states(bridge, states, te_spec=te_spec, grouped_gemm=te_spec)
    _equal_states(bridge.megatron_to_hf(merged), hf)


def test_moe_rank_holds_only_its_experts_and_stage_layers(tiny_states):
    config, hf = tiny_states["mixtral"]
    bridge = Bridge.from_hf_config(config, tp_size=2)
    canonical = bridge.hf_to_megatron(hf)
    pos = all_positions(tp=2, pp=2, ep=2)[-1]  # tp 1, pp 1, ep 1
    state = split_state(bridge, canonical, pos)
    experts = sorted({n.split(".")[6] for n in state if "local_experts" in n})
    assert experts == ["0", "1"]  # chunk-local indices of global experts 2, 3
    w1_global3 = hf["model.layers.1.block_sparse_moe.experts.3.w1.weight"]
    local = state["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert torch.equal(local[:64], w1_global3[64:])  # TP rank 1 holds the second half of gate rows
    assert "embedding.word_embeddings.weight" not in state and "output_layer.weight" in state


def test_te_and_grouped_gemm_spellings_round_trip():
    naming = ChunkNaming(
        layer_offset=2, expert_offset=4, num_local_experts=4, te_spec=True, grouped_gemm=True
    )
    dense = ChunkNaming(layer_offset=2, te_spec=True)
    assert dense.from_canonical("decoder.layers.3.input_layernorm.weight") == (
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"
    )
    assert dense.from_canonical("decoder.layers.3.pre_mlp_layernorm.weight") == (
        "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"
    )
    moe = ChunkNaming(
        layer_offset=2, expert_offset=4, num_local_experts=4, te_spec=True, grouped_gemm=True, moe=True
    )
    assert (
        moe.from_canonical("decoder.layers.3.pre_mlp_layernorm.weight")
        == "decoder.layers.1.pre_mlp_layernorm.weight"
    )
    canonical = "decoder.layers.3.mlp.experts.local_experts.6.linear_fc2.weight"
    assert naming.from_canonical(canonical) == "decoder.layers.1.mlp.experts.linear_fc2.weight2"
    assert naming.to_canonical("decoder.layers.1.mlp.experts.linear_fc2.weight2") == canonical
    assert naming.owns_expert(canonical) and not naming.owns_expert(canonical.replace(".6.", ".3."))


def test_unknown_model_type_lists_supported():
    with pytest.raises(
        KeyError,
        match=r"gpt_neox.*deepseek_v2, deepseek_v3, glm4_moe, gpt_oss, kimi_k2, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe",
    ):
        get_family("gpt_neox")
    assert "qwen3_moe" in family_types()


def test_missing_expert_tensor_is_named(tiny_states):
    config, hf = tiny_states["qwen2_moe"]
    broken = {k: v for k, v in hf.items() if k != "model.layers.1.mlp.experts.2.up_proj.weight"}
    with pytest.raises(KeyError, match=r"missing tensors \['model.layers.1.mlp.experts.2.up_proj.weight'\]"):
        Bridge.from_hf_config(config).hf_to_megatron(broken)


def test_mis_shaped_tensor_is_named(tiny_states):
    config, hf = tiny_states["llama"]
    broken = dict(hf)
    broken["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(48, 128)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        Bridge.from_hf_config(config).hf_to_megatron(broken)
