"""GPT-OSS's bridge rows on hand-built tensors: the interleaved, transposed ``gate_up_proj`` and its
bias become Megatron's ``[gate; up]`` rows, ``down_proj`` its transpose, the sinks split by head over
TP; a table without the sinks row refuses the checkpoint naming them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_bridge import registry
from megatron_bridge.bridge import Bridge
from megatron_bridge.dims import ModelDims
from megatron_bridge.models.gpt_oss import InterleavedGatedMLP, TransposedRowParallel
from rltrain.models.tiny import tiny_hf_config

DIMS = ModelDims("gpt_oss", 1, 3, 2, 1, 2, 8, 8, False, num_experts=2)


def test_interleaved_gate_up_becomes_gate_rows_then_up_rows() -> None:
    # one expert, hidden 3, ffn 2: column 2j is gate j, column 2j + 1 is up j (x @ gate_up_proj)
    gate = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # [ffn, hidden] as a Linear's weight
    up = -gate
    stored = torch.stack([gate.t(), up.t()], dim=2).reshape(3, 4)  # [hidden, 2 × ffn]
    assert stored[:, 0].tolist() == [1.0, 2.0, 3.0] and stored[:, 1].tolist() == [-1.0, -2.0, -3.0]
    row = InterleavedGatedMLP("fc1", "gate_up_proj")
    (fc1,) = row.to_megatron([stored], DIMS)
    assert torch.equal(fc1, torch.cat([gate, up]))
    (back,) = row.to_hf([fc1], DIMS)
    assert torch.equal(back, stored) and back.is_contiguous()
    bias = torch.tensor([10.0, -10.0, 20.0, -20.0])  # gate 0, up 0, gate 1, up 1
    (fc1_bias,) = row.to_megatron([bias], DIMS)
    assert fc1_bias.tolist() == [10.0, 20.0, -10.0, -20.0]
    assert torch.equal(row.to_hf([fc1_bias], DIMS)[0], bias)
    # over TP=2 each rank holds its gate row and its up row
    assert row.shard(fc1, rank=1, size=2).tolist() == [[4.0, 5.0, 6.0], [-4.0, -5.0, -6.0]]


def test_down_proj_is_the_transpose_of_megatron_fc2() -> None:
    down = torch.arange(6.0).reshape(2, 3)  # [ffn, hidden]
    row = TransposedRowParallel("fc2", "down_proj")
    (fc2,) = row.to_megatron([down], DIMS)
    assert torch.equal(fc2, down.t()) and fc2.is_contiguous()
    assert torch.equal(row.to_hf([fc2], DIMS)[0], down)


def test_sinks_split_by_head_and_a_table_without_them_is_refused() -> None:
    hf = tiny_hf_config("gpt_oss", vocab_size=448)
    bridge = Bridge.from_hf_config(hf)
    (sinks,) = [u for u in bridge.units if u.hf_names == ("model.layers.0.self_attn.sinks",)]
    assert sinks.megatron_names == ("decoder.layers.0.self_attention.core_attention.softmax_offset",)
    row = sinks.mapping
    assert row.shard(torch.arange(4.0), rank=1, size=2).tolist() == [2.0, 3.0]  # heads 2 and 3
    family = registry.get_family("gpt_oss")
    rows = tuple(r for r in family.mappings if not r.megatron.endswith("softmax_offset"))
    without = Bridge(dataclasses.replace(family, mappings=rows), bridge.dims)
    state = {name: torch.zeros(1) for unit in bridge.units for name in unit.hf_names}
    with pytest.raises(KeyError, match=r"unexpected tensors \['model.layers.0.self_attn.sinks'"):
        without.hf_to_megatron(state)
