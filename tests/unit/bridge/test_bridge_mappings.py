"""Mapping primitives against hand-built references (head/row labels), not only shapes."""

from __future__ import annotations

import pytest
import torch

from megatron_bridge.dims import ModelDims, padded_vocab_size
from megatron_bridge.mappings import (
    QKV,
    FusedGatedMLP,
    GatedMLP,
    GroupedExperts,
    PerExpert,
    Replicated,
    RowParallel,
    VocabParallel,
)

DIMS = ModelDims(
    model_type="llama",
    num_layers=1,
    hidden_size=4,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=2,
    vocab_size=5,
    padded_vocab_size=8,
    tie_word_embeddings=False,
    num_experts=3,
)


def _labelled(rows: int, base: float, cols: int = 4) -> torch.Tensor:
    """Row r holds base + r in every column, so a row's origin is readable from its value."""
    return (base + torch.arange(rows, dtype=torch.float32)).unsqueeze(1).repeat(1, cols)


def test_qkv_packs_query_heads_with_their_kv_group_and_splits_by_group():
    q, k, v = _labelled(8, 100), _labelled(4, 200), _labelled(4, 300)  # 4 q heads, 2 kv heads, d=2
    mapping = QKV("qkv", "q", k="k", v="v")
    (fused,) = mapping.to_megatron([q, k, v], DIMS)
    # group 0: q heads 0,1 (rows 0-3), k head 0, v head 0; then group 1.
    expected = [100, 101, 102, 103, 200, 201, 300, 301, 104, 105, 106, 107, 202, 203, 302, 303]
    assert fused[:, 0].tolist() == expected
    assert mapping.shard(fused, rank=1, size=2)[:, 0].tolist() == expected[8:]
    back = mapping.to_hf([fused], DIMS)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_qkv_bias_uses_the_same_packing():
    q, k, v = torch.arange(8.0), torch.arange(4.0) + 50, torch.arange(4.0) + 90
    (fused,) = QKV("b", "q", k="k", v="v").to_megatron([q, k, v], DIMS)
    assert fused.tolist() == [0, 1, 2, 3, 50, 51, 90, 91, 4, 5, 6, 7, 52, 53, 92, 93]


def test_gated_mlp_rank_holds_its_slice_of_gate_and_of_up():
    gate, up = _labelled(4, 10), _labelled(4, 20)
    mapping = GatedMLP("fc1", "gate", up="up")
    (fc1,) = mapping.to_megatron([gate, up], DIMS)
    shards = [mapping.shard(fc1, rank=r, size=2) for r in range(2)]
    assert shards[0][:, 0].tolist() == [10, 11, 20, 21]
    assert shards[1][:, 0].tolist() == [12, 13, 22, 23]
    assert torch.equal(mapping.unshard(shards), fc1)


def test_row_column_replicated_split_dims():
    w = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(RowParallel("a", "b").shard(w, rank=1, size=2), w[:, 3:])
    assert torch.equal(Replicated("a", "b").shard(w, rank=1, size=2), w)
    with pytest.raises(ValueError, match=r"fc2.*not divisible by 4"):
        RowParallel("fc2", "b").shard(torch.zeros(2, 6), rank=0, size=4)


def test_vocab_pads_with_zero_rows_and_unpads():
    emb = _labelled(5, 1)
    mapping = VocabParallel("emb", "embed")
    (padded,) = mapping.to_megatron([emb], DIMS)
    assert padded.shape == (8, 4) and torch.equal(padded[5:], torch.zeros(3, 4))
    assert torch.equal(mapping.shard(padded, rank=1, size=2), torch.cat([emb[4:], torch.zeros(3, 4)]))
    assert torch.equal(mapping.to_hf([padded], DIMS)[0], emb)
    assert padded_vocab_size(393, tp_size=2) == 512 and padded_vocab_size(49152, tp_size=2) == 49152


def test_grouped_experts_match_per_expert_layout():
    gate_up = torch.stack([torch.cat([_labelled(2, 10 * e), _labelled(2, 10 * e + 5)]) for e in range(3)])
    grouped = GroupedExperts(FusedGatedMLP("l.*.experts.*.fc1", "l.*.experts.gate_up_proj"))
    per_expert = PerExpert(GatedMLP("l.*.experts.*.fc1", "l.*.experts.*.gate", up="l.*.experts.*.up"))
    assert grouped.megatron_names((0,), DIMS) == [
        "l.0.experts.0.fc1",
        "l.0.experts.1.fc1",
        "l.0.experts.2.fc1",
    ]
    from_grouped = grouped.to_megatron([gate_up], DIMS)
    for e in range(3):
        gate, up = gate_up[e].chunk(2)
        assert torch.equal(from_grouped[e], per_expert.to_megatron([gate, up], DIMS)[0])
    assert torch.equal(grouped.to_hf(from_grouped, DIMS)[0], gate_up)
    assert grouped.shard(from_grouped[1], rank=1, size=2)[:, 0].tolist() == [11, 16]
    assert per_expert.is_expert and grouped.is_expert and not GatedMLP("a", "b", up="c").is_expert
