"""rltrain's packed RoPE returns Megatron's unfused THD result bit for bit, values and gradients.

The reference is Megatron-Core's own ``rope_utils.apply_rotary_pos_emb`` (the installed 0.16.1) on
the same tensors, with the frequency table from Megatron's ``RotaryEmbedding``; the positions are
also checked against hand-derived ones.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer import TransformerConfig

from rltrain.megatron import packed_rope

LENGTHS = [5, 1, 17, 16, 2, 33, 9, 3, 1, 12]


def config(*, interleaved: bool = False) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        rotary_interleaved=interleaved,
        apply_rope_fusion=False,
    )


def table(rows: int, *, dim: int = 8, percent: float = 1.0, interleaved: bool = False) -> torch.Tensor:
    """Megatron's frequency table [rows, 1, 1, dim·percent] (its RotaryEmbedding, built on CPU)."""
    rope = RotaryEmbedding(
        kv_channels=dim, rotary_percent=percent, rotary_interleaved=interleaved, use_cpu_initialization=True
    )
    freqs = rope.get_freqs_non_repeated(rows)
    if interleaved:
        return torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(rows, -1)[:, None, None, :]
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def rotated(
    fn, heads: int, cu: torch.Tensor, freqs: torch.Tensor, cfg, *, mscale: float = 1.0, seed: int = 0
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(int(cu[-1]), heads, 8, generator=gen).requires_grad_()
    out = fn(x, freqs, cfg, cu_seqlens=cu, mscale=mscale, cp_group=dist.group.WORLD)
    (out * torch.randn(out.shape, generator=gen)).sum().backward()
    return out.detach(), x.grad


def assert_same_bits(cu, freqs, cfg, *, mscale: float = 1.0) -> None:
    # Query (4 heads) then key (2 heads) with the same table and cu_seqlens: the second call reuses
    # the cached cos/sin, as in a layer.
    for heads, seed in ((4, 0), (2, 1), (4, 2)):
        mine = rotated(packed_rope.apply_rotary_pos_emb, heads, cu, freqs, cfg, mscale=mscale, seed=seed)
        theirs = rotated(rope_utils.apply_rotary_pos_emb, heads, cu, freqs, cfg, mscale=mscale, seed=seed)
        for a, b in zip(mine, theirs):
            assert a.shape == b.shape and torch.equal(a, b)


def test_positions_restart_per_sequence_or_follow_the_row_when_the_table_is_the_rows_length() -> None:
    cu = cu_of([3, 1, 2])
    assert packed_rope.packed_positions(cu, freqs_len=40).tolist() == [0, 1, 2, 0, 0, 1]
    # Megatron's "exact mapping": a table exactly as long as the row is indexed by packed position.
    assert packed_rope.packed_positions(cu, freqs_len=6).tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_packed_rope_equals_megatrons_thd_path_bit_for_bit(gloo_world_of_one, interleaved, percent) -> None:
    cfg = config(interleaved=interleaved)
    freqs = table(64, percent=percent, interleaved=interleaved)
    for lengths in (LENGTHS, [40], [1, 1, 1]):
        assert_same_bits(cu_of(lengths), freqs, cfg)
    assert_same_bits(cu_of(LENGTHS), freqs, cfg, mscale=0.7)


def test_a_table_as_long_as_the_row_is_indexed_by_packed_position_as_megatron_does(gloo_world_of_one) -> None:
    cu = cu_of(LENGTHS)
    assert_same_bits(cu, table(int(cu[-1])), config())


def test_a_new_micro_batch_gets_its_own_cos_and_sin(gloo_world_of_one) -> None:
    cfg, freqs = config(), table(64)
    assert_same_bits(cu_of(LENGTHS), freqs, cfg)
    # Another row of the same total length but other sequences: positions differ, so must the result.
    other = cu_of([LENGTHS[0] + LENGTHS[1], *LENGTHS[2:]])
    assert_same_bits(other, freqs, cfg)
    first = rotated(packed_rope.apply_rotary_pos_emb, 4, cu_of(LENGTHS), freqs, cfg)[0]
    second = rotated(packed_rope.apply_rotary_pos_emb, 4, other, freqs, cfg)[0]
    assert not torch.equal(first, second)


def test_bshd_rows_go_to_megatron_unchanged(gloo_world_of_one) -> None:
    cfg, freqs = config(), table(12)
    x = torch.randn(12, 3, 4, 8, generator=torch.Generator().manual_seed(0))
    mine = packed_rope.apply_rotary_pos_emb(x, freqs, cfg, cu_seqlens=None, cp_group=dist.group.WORLD)
    assert torch.equal(mine, rope_utils.apply_rotary_pos_emb(x, freqs, cfg, cp_group=dist.group.WORLD))


def test_install_replaces_the_name_megatrons_attention_calls_once() -> None:
    attention = importlib.import_module("megatron.core.transformer.attention")
    before = attention.apply_rotary_pos_emb
    try:
        attention.apply_rotary_pos_emb = rope_utils.apply_rotary_pos_emb  # what Megatron imports
        packed_rope.install_packed_rope()
        packed_rope.install_packed_rope()
        # Installed once, and what it hands the cases it does not take is the function it replaced.
        assert attention.apply_rotary_pos_emb is packed_rope.apply_rotary_pos_emb
        assert packed_rope.rope_utils.apply_rotary_pos_emb is rope_utils.apply_rotary_pos_emb
    finally:
        attention.apply_rotary_pos_emb = before
