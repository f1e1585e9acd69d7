"""Packed causal attention equals block-diagonal masked attention, and its memory is linear in the pack.

The reference is the masked formula the trainer used before: scores over the whole [tokens, tokens]
row, a block-diagonal causal mask, softmax, then the values. Memory is counted by
``LiveTensorBytes``: the bytes of every tensor storage an operation creates while the mode is on,
from creation until it is freed, so the peak is what the computation held at once (deterministic,
unlike resident memory on a busy machine; allocations inside one kernel, such as SDPA's fixed-size
blocks, are not seen).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rltrain.megatron.packed_attention import packed_causal_attention, segment_groups

# Ragged lengths: single tokens, lengths just over and under powers of two, and a trailing
# padding segment as pack_sequences appends.
LENGTHS = [5, 1, 17, 16, 2, 33, 9, 3, 32, 1, 12, 6]
HEADS, GROUPS, DIM = 4, 2, 8
SCALE = 0.3


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, hf_window: int | None = None
) -> torch.Tensor:
    """The dense reference: [tokens, tokens] block-diagonal causal mask over the whole row; with
    ``hf_window`` also transformers' sliding window (a key is seen when key > query - hf_window)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_id = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    tokens = seq_id.numel()
    forbidden = (seq_id[:, None] != seq_id[None, :]) | torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
    if hf_window is not None:
        position = torch.arange(tokens)
        forbidden |= ~(position[None, :] > position[:, None] - hf_window)
    repeats = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    probs = scores.masked_fill(forbidden, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def qkv(tokens: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(tokens, HEADS, DIM), (tokens, GROUPS, DIM), (tokens, GROUPS, DIM)]
    return [torch.randn(shape, generator=gen).requires_grad_() for shape in shapes]


def values_and_grads(attention: Any, lengths: list[int]) -> list[torch.Tensor]:
    cu = cu_seqlens_of(lengths)
    q, k, v = qkv(int(cu[-1]))
    out = attention(q, k, v, cu)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * weights).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    return packed_causal_attention(q, k, v, cu, scale=SCALE)


def test_segments_are_grouped_by_length_class_with_end_padding() -> None:
    groups = segment_groups(cu_seqlens_of([3, 1, 4, 0, 2]))
    assert [g.gather_index.tolist() for g in groups] == [[[0, 1, 2, 2], [4, 5, 6, 7]], [[3]], [[8, 9]]]
    assert [g.valid.sum(1).tolist() for g in groups] == [[3, 4], [1], [2]]


def scaled_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference, relative to the reference's scale where that exceeds 1 (fp32 keeps ~7 digits)."""
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def test_packed_equals_masked_attention_values_and_gradients() -> None:
    for lengths in (LENGTHS, [40], [1, 1, 1], [7, 7, 7, 7]):
        new = values_and_grads(packed, lengths)
        ref = values_and_grads(masked_attention, lengths)
        for name, a, b in zip(("output", "dq", "dk", "dv"), new, ref):
            assert scaled_diff(a, b) <= 1e-6, f"{lengths}: {name} differs by {scaled_diff(a, b):.3g}"
        if max(lengths) > 1:  # the gradients compared are not trivially zero
            assert min(float(g.abs().max()) for g in ref[1:]) > 0.1


def test_a_sliding_window_equals_transformers_window_values_and_gradients() -> None:
    """Megatron's window_size=(w - 1, 0) is transformers' sliding_window=w: w keys, itself included."""
    for hf_window in (1, 3, 8):
        windowed = functools.partial(packed_causal_attention, scale=SCALE, window_left=hf_window - 1)
        reference = functools.partial(masked_attention, hf_window=hf_window)
        for lengths in (LENGTHS, [40]):
            new = values_and_grads(windowed, lengths)
            ref = values_and_grads(reference, lengths)
            for name, a, b in zip(("output", "dq", "dk", "dv"), new, ref):
                diff = scaled_diff(a, b)
                assert diff <= 1e-6, f"w={hf_window} {lengths}: {name} differs by {diff:.3g}"
            # segments longer than the window: the window changes the result
            assert scaled_diff(new[0], values_and_grads(packed, lengths)[0]) > 1e-2


def test_a_single_segment_is_plain_causal_attention() -> None:
    q, k, v = qkv(10)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=SCALE, enable_gqa=True
    ).transpose(0, 1)
    assert torch.allclose(packed(q, k, v, cu_seqlens_of([10])), expected, atol=1e-6)


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created by operations while the mode is on and still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._alive:
            return
        self._alive.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, storage.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        self._alive.discard(key)
        self.live -= nbytes


def peak_bytes(attention: Any, repeats: int) -> int:
    with LiveTensorBytes() as meter:
        values_and_grads(attention, LENGTHS * repeats)
    return meter.peak


def test_the_meter_sees_a_freed_tensor_go() -> None:
    with LiveTensorBytes() as meter:
        a = torch.ones(1000)
        b = a * 2
        del b
        c = a + 1
    assert meter.peak == 2 * 4000 and meter.live == 2 * 4000
    del a, c


def test_packed_peak_memory_grows_linearly_with_the_pack() -> None:
    small, large = (peak_bytes(packed, repeats) for repeats in (2, 8))
    masked_small, masked_large = (peak_bytes(masked_attention, repeats) for repeats in (2, 8))
    # 4x the tokens: linear memory grows ~4x, a [tokens, tokens] matrix 16x (the meter sees that).
    assert masked_large / masked_small > 12
    assert large / small < 5
    assert large * 10 < masked_large


def test_a_row_of_one_length_class_skips_the_reorder_with_the_same_bits() -> None:
    from rltrain.megatron import packed_attention

    cu = cu_seqlens_of([9, 12, 16, 10])  # one class, (8, 16]: the output is already in packed order
    plan = packed_attention._row_plan(cu)
    assert plan.order is None
    fast = values_and_grads(lambda q, k, v, _: packed(q, k, v, cu), [9, 12, 16, 10])
    plan.order = torch.arange(int(cu[-1]))  # force the general path: concatenate, then reorder
    general = values_and_grads(lambda q, k, v, _: packed(q, k, v, cu), [9, 12, 16, 10])
    assert all(torch.equal(a, b) for a, b in zip(fast, general))
    # Several classes: the groups' outputs interleave in packed order, so they are reordered.
    order = packed_attention._row_plan(cu_seqlens_of(LENGTHS)).order
    assert order is not None and not torch.equal(order, torch.arange(sum(LENGTHS)))


def test_window_keys_are_the_query_and_the_left_keys_before_it():
    from rltrain.megatron.packed_attention import window_keys

    # transformers' window of 2 keys (query i sees i-1 and i) is Megatron's window_size=(1, 0)
    assert window_keys(4, 1).int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 1, 1, 0],
        [0, 0, 1, 1],
    ]


def transformers_sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    sinks: torch.Tensor,
    hf_window: int | None,
) -> torch.Tensor:
    """transformers' GPT-OSS ``eager_attention_forward`` run on each sequence of the row on its own,
    with the causal (and sliding-window) additive mask transformers gives it."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = SimpleNamespace(sinks=sinks, num_key_value_groups=HEADS // GROUPS, training=False)
    outputs = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        n = end - start
        position = torch.arange(n)
        seen = position[None, :] <= position[:, None]
        if hf_window is not None:
            seen &= position[None, :] > position[:, None] - hf_window
        mask = torch.zeros(n, n).masked_fill(~seen, torch.finfo(torch.float32).min)[None, None]
        one = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]  # [1, heads, n, dim]
        out, _ = eager_attention_forward(module, *one, mask, scaling=SCALE)
        outputs.append(out[0])  # [n, heads, dim]
    return torch.cat(outputs)


def test_attention_sinks_equal_transformers_gpt_oss_values_and_gradients() -> None:
    """The sink logit of each head joins the softmax denominator and adds no value: transformers'
    GPT-OSS attention, with and without the sliding window; the sinks' own gradient matches too."""
    for hf_window in (None, 3):
        for lengths in (LENGTHS, [40]):
            results = []
            for attention in ("packed", "transformers"):
                sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0]).requires_grad_()
                if attention == "packed":
                    window = None if hf_window is None else hf_window - 1
                    fn = functools.partial(
                        packed_causal_attention, scale=SCALE, window_left=window, sinks=sinks
                    )
                else:
                    fn = functools.partial(transformers_sink_attention, sinks=sinks, hf_window=hf_window)
                results.append([*values_and_grads(fn, lengths), sinks.grad])
            new, ref = results
            for name, a, b in zip(("output", "dq", "dk", "dv", "dsinks"), new, ref):
                diff = scaled_diff(a, b)
                assert diff <= 1e-6, f"w={hf_window} {lengths}: {name} differs by {diff:.3g}"
            # the sinks change the result: without them it is plain (windowed) attention
            window = None if hf_window is None else hf_window - 1
            plain = functools.partial(packed_causal_attention, scale=SCALE, window_left=window)
            assert scaled_diff(new[0], values_and_grads(plain, lengths)[0]) > 1e-2
            assert float(ref[4].abs().max()) > 1e-2


def test_a_sink_takes_its_share_of_a_single_key() -> None:
    """Hand-derived: a one-token sequence has one key of score s; its output is v · e^s / (e^s + e^sink)."""
    q, k, v = (torch.randn(1, 1, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    sink = torch.tensor([0.7])
    out = packed_causal_attention(q, k, v, cu_seqlens_of([1]), scale=SCALE, sinks=sink)
    score = float((q * k).sum()) * SCALE
    weight = torch.sigmoid(torch.tensor(score) - sink)  # e^s / (e^s + e^sink)
    assert torch.allclose(out, v * weight, atol=1e-7, rtol=0)
