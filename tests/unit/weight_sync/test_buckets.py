"""Bucketing: group-aligned cuts, sizes, and bit-exact pack/unpack."""

import pytest
import torch

from megatron_bridge.vllm_names import fused_group, grouped_order
from rltrain.weight_sync.buckets import BufferPool, iter_buckets, pack_bucket, unpack_bucket


def _layer(i: int) -> list[tuple[str, torch.Tensor]]:
    p = f"model.layers.{i}."
    shapes = {
        "input_layernorm.weight": (8,),
        "self_attn.q_proj.weight": (8, 8),
        "self_attn.k_proj.weight": (4, 8),
        "self_attn.v_proj.weight": (4, 8),
        "self_attn.o_proj.weight": (8, 8),
        "mlp.gate_proj.weight": (16, 8),
        "mlp.up_proj.weight": (16, 8),
        "mlp.down_proj.weight": (8, 16),
    }
    return [(p + k, torch.randn(s)) for k, s in shapes.items()]


def test_fused_group_names():
    assert fused_group("model.layers.3.self_attn.k_proj.weight") == "model.layers.3.self_attn.qkv_proj"
    assert fused_group("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.gate_up_proj"
    assert fused_group("model.layers.3.mlp.down_proj.weight") == "model.layers.3.mlp.down_proj"
    assert fused_group("model.layers.1.mlp.experts.7.down_proj.weight") == "model.layers.1.mlp.experts"
    assert fused_group("lm_head.weight") == "lm_head"
    # DeepSeek's MLA down projections load into vLLM's fused_qkv_a_proj together (its mla_params_mapping)
    for name in ("q_a_proj", "kv_a_proj_with_mqa"):
        assert (
            fused_group(f"model.layers.0.self_attn.{name}.weight")
            == "model.layers.0.self_attn.fused_qkv_a_proj"
        )
    assert fused_group("model.layers.2.mlp.gate.e_score_correction_bias") == "model.layers.2.mlp.gate"


def test_buckets_never_split_a_fused_group_and_keep_order():
    stream = _layer(0) + _layer(1)
    # q,k,v of one layer = (64 + 32 + 32) * 4 = 512 bytes; a 300-byte bucket must still hold them together
    buckets = list(iter_buckets(stream, 300))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in stream]
    for b in buckets:
        groups = {fused_group(n) for n, _ in b}
        for g in groups:
            members = [n for n, _ in stream if fused_group(n) == g]
            assert all(m in {n for n, _ in b} for m in members), g
    sizes = [sum(t.numel() * 4 for _, t in b) for b in buckets]
    # gate+up (1024 B) and qkv (512 B) are oversize groups; every other bucket stays within 300 B
    assert all(s <= 300 or len({fused_group(n) for n, _ in b}) == 1 for s, b in zip(sizes, buckets))
    assert len(list(iter_buckets(stream, 1 << 30))) == 1


def test_ungrouped_stream_raises_naming_the_module():
    stream = _layer(0)
    stream = [stream[1], stream[0], stream[2], stream[3]]  # q, norm, k, v: qkv group interrupted
    with pytest.raises(ValueError, match="qkv_proj"):
        list(iter_buckets(stream, 1 << 20))


def test_pack_unpack_bit_exact_mixed_dtypes():
    bucket = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)), ("c", torch.arange(5))]
    packed = pack_bucket(bucket)
    assert packed.flat.dtype == torch.uint8 and all(m.offset % 16 == 0 for m in packed.metas)
    for (name, t), (name2, t2) in zip(bucket, unpack_bucket(packed)):
        assert name == name2 and t2.dtype == t.dtype and torch.equal(t, t2)


def test_grouped_order_makes_a_sorted_state_dict_bucketable():
    stream = sorted(_layer(0) + _layer(1))  # alphabetical: o_proj sits between k_proj and q_proj
    with pytest.raises(ValueError):
        list(iter_buckets(stream, 1 << 20))
    regrouped = grouped_order(stream)
    assert sorted(regrouped) == stream
    assert [n for b in iter_buckets(regrouped, 1 << 20) for n, _ in b] == [n for n, _ in regrouped]


def test_buffer_pool_reuses_its_buffers_and_packs_bit_exact_into_them():
    pool = BufferPool(num_buffers=2)
    a, b, c = pool.take(100), pool.take(50), pool.take(60)
    assert a.numel() == 100 and b.numel() == 50 and c.numel() == 60
    assert c.data_ptr() == a.data_ptr()  # the first buffer again, big enough: no new allocation
    d = pool.take(80)
    assert d.data_ptr() != b.data_ptr() and d.numel() == 80  # the second grew
    bucket = [("x", torch.randn(3, 5)), ("y", torch.arange(7, dtype=torch.int64))]
    first = pack_bucket(bucket, pool=BufferPool())
    pool = BufferPool()
    for _ in range(2):
        packed = pack_bucket(bucket, pool=pool)
        assert all(torch.equal(t, u) for (_, t), (_, u) in zip(bucket, unpack_bucket(packed)))
    assert packed.flat.data_ptr() == pool.take(1).data_ptr() and packed.metas == first.metas
    with pytest.raises(ValueError, match="num_buffers must be >= 1"):
        BufferPool(num_buffers=0)
