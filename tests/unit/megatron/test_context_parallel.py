"""Context-parallel split of packed rows (Megatron's load balancing) and the CP attention on one process.

The attention reference is ``packed_causal_attention`` over the whole row; CP ranks are simulated
by running each rank's share of the queries against the whole row's keys/values.
"""

from __future__ import annotations

import pytest
import torch

import rltrain.megatron.packed_attention as packed_attention_module
from rltrain.data.packing import context_parallel_index, pack_sequences
from rltrain.megatron.packed_attention import context_parallel_causal_attention, packed_causal_attention

HEADS, GROUPS, DIM = 4, 2, 8
SCALE = 0.3


def test_each_sequence_is_padded_to_2cp_and_keeps_its_tokens() -> None:
    input_ids = torch.tensor([[0, 5, 6, 7, 8, 9], [1, 2, 0, 0, 0, 0], [3, 4, 5, 6, 0, 0]])
    packed = pack_sequences(input_ids, (input_ids != 0).long(), pad_each_to_multiple=4, pad_to_multiple=8)
    # Lengths 5, 2, 4 → 8, 4, 4 (16 tokens, already a multiple of 8: no padding segment).
    assert packed.cu_seqlens.tolist() == [0, 8, 12, 16]
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0, 1, 2, 0, 0, 3, 4, 5, 6]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 0, 1, 2, 3]]
    assert packed.token_index.tolist() == [
        [-1, 0, 1, 2, 3, 4],
        [8, 9, -1, -1, -1, -1],
        [12, 13, 14, 15, -1, -1],
    ]
    assert packed.max_seqlen == 8 and packed.pad_tokens == 0


def test_cp_split_takes_chunks_r_and_mirror_of_every_segment() -> None:
    cu = torch.tensor([0, 8, 12, 16], dtype=torch.int32)
    # CP=2: 4 chunks per segment; segment 0 has chunks of 2, segments 1 and 2 chunks of 1.
    assert context_parallel_index(cu, cp_size=2, cp_rank=0).tolist() == [0, 1, 6, 7, 8, 11, 12, 15]
    assert context_parallel_index(cu, cp_size=2, cp_rank=1).tolist() == [2, 3, 4, 5, 9, 10, 13, 14]
    cu4 = torch.tensor([0, 8, 24], dtype=torch.int32)
    # CP=4: 8 chunks; segment 0 chunks of 1, segment 1 chunks of 2.
    assert context_parallel_index(cu4, cp_size=4, cp_rank=1).tolist() == [1, 6, 10, 11, 20, 21]
    assert context_parallel_index(cu4, cp_size=4, cp_rank=3).tolist() == [3, 4, 14, 15, 16, 17]


def test_cp_split_of_a_ragged_batch_is_balanced_and_covers_every_token_once() -> None:
    lengths = [37, 1, 5, 120, 64, 3, 18]
    mask = torch.zeros(len(lengths), 128, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    packed = pack_sequences(mask * 7, mask, pad_each_to_multiple=4, pad_to_multiple=8)
    shares = [context_parallel_index(packed.cu_seqlens, cp_size=2, cp_rank=r) for r in range(2)]
    total = int(packed.cu_seqlens[-1])
    assert sorted(torch.cat(shares).tolist()) == list(range(total))
    # Equal shares: every segment contributes half its padded length to each rank (hand count:
    # padded lengths 40+4+8+120+64+4+20 = 260, then 4 of padding segment = 264 → 132 each).
    assert total == 264 and [s.numel() for s in shares] == [132, 132]
    # Causal work (keys up to each query, summed): per segment of 2·CP·c tokens, rank r's two chunks
    # cost c·(rc + (c+1)/2) + c·((2CP−1−r)c + (c+1)/2) = (2CP−1)c² + c(c+1), the same for every r.
    work = []
    for share in shares:
        seg = torch.searchsorted(packed.cu_seqlens[1:].long(), share, right=True)
        work.append(int((share - packed.cu_seqlens[seg].long() + 1).sum()))
    chunks = [(n + (-n) % 4) // 4 for n in lengths] + [1]  # padding segment: 4 tokens
    assert work == [sum(3 * c * c + c * (c + 1) for c in chunks)] * 2


def _qkv(tokens: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(tokens, HEADS, DIM), (tokens, GROUPS, DIM), (tokens, GROUPS, DIM)]
    return [torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes]


# Every segment mask-free (merged flash calls), or every segment through the masked call.
@pytest.mark.parametrize("merged_min_chunk", [1, 10**9], ids=["merged", "masked"])
def test_cp_attention_equals_packed_attention_on_the_whole_row_with_gradients(
    monkeypatch, merged_min_chunk
) -> None:
    monkeypatch.setattr(packed_attention_module, "MERGED_MIN_CHUNK", merged_min_chunk)
    # Multiples of 2·CP = 4; groups by length class hold different chunk sizes (20, 28, 32; 40).
    lengths = [12, 4, 40, 8, 20, 4, 32, 28]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tokens = int(cu[-1])
    q, k, v = _qkv(tokens, seed=1)
    weight = torch.randn(tokens, HEADS, DIM, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    reference = packed_causal_attention(q, k, v, cu, scale=SCALE)
    (reference * weight).sum().backward()
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    for cp in (2,):
        for t in (q, k, v):
            t.grad = None
        for rank in range(cp):
            index = context_parallel_index(cu, cp_size=cp, cp_rank=rank)
            out = context_parallel_causal_attention(q[index], k, v, cu, cp_size=cp, cp_rank=rank, scale=SCALE)
            assert (out - reference[index]).abs().max() < 1e-12
            (
                out * weight[index]
            ).sum().backward()  # gradients of all ranks add up, as the K/V gather's backward
        for got, expected in zip((q.grad, k.grad, v.grad), ref_grads):
            assert (got - expected).abs().max() < 1e-12


@pytest.mark.parametrize("merged_min_chunk", [2, 10**9], ids=["mixed", "masked"])
def test_cp4_attention_equals_packed_attention(monkeypatch, merged_min_chunk) -> None:
    monkeypatch.setattr(packed_attention_module, "MERGED_MIN_CHUNK", merged_min_chunk)
    lengths = [16, 8, 32, 8, 24]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = _qkv(int(cu[-1]), seed=3)
    with torch.no_grad():
        reference = packed_causal_attention(q, k, v, cu, scale=SCALE)
        for rank in range(4):
            index = context_parallel_index(cu, cp_size=4, cp_rank=rank)
            out = context_parallel_causal_attention(q[index], k, v, cu, cp_size=4, cp_rank=rank, scale=SCALE)
            assert (out - reference[index]).abs().max() < 1e-12
