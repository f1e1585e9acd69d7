"""Lossless round trip and exact sizes of the sparse-delta encodings (``bench/delta_codec.py``)."""

import pytest
import torch

from bench.delta_codec import ENCODERS, bf16_bits, decode


def _pair() -> tuple[torch.Tensor, torch.Tensor]:
    """20 fp32 weights; the update sets elements 1, 7 and 19 to values bf16 holds exactly, and element 4
    by 1e-6, which bf16 (8 mantissa bits: a step of 2**-7 at 1.0) rounds away."""
    prev = torch.linspace(-1.0, 1.0, 20)
    new = prev.clone()
    new[1] = 0.5
    new[7] = -3.0
    new[19] *= 2.0
    new[4] += 1e-6
    return bf16_bits(prev), bf16_bits(new)


def test_bf16_bits_see_only_changes_that_survive_rounding() -> None:
    prev, new = _pair()
    assert torch.nonzero(prev != new).reshape(-1).tolist() == [1, 7, 19]


@pytest.mark.parametrize("encoding", sorted(ENCODERS))
def test_round_trip_is_bit_exact(encoding: str) -> None:
    prev, new = _pair()
    delta = ENCODERS[encoding](prev, new)
    assert torch.equal(decode(prev, delta), new)
    assert torch.equal(decode(new, ENCODERS[encoding](new, new)), new)  # an empty delta


def test_positions_bytes() -> None:
    prev, new = _pair()
    delta = ENCODERS["positions"](prev, new)
    assert delta.num_bytes == 3 * (4 + 2)  # int32 index + bf16 value per changed element
    assert delta.parts[0].tolist() == [1, 7, 19]


def test_bitmap_bytes_and_bit_order() -> None:
    prev, new = _pair()
    delta = ENCODERS["bitmap"](prev, new)
    assert delta.num_bytes == 3 + 3 * 2  # ceil(20 / 8) mask bytes + bf16 value per changed element
    # bit i of byte i // 8 is element i (little-endian): 2**1 + 2**7 = 130; element 19 -> byte 2, bit 3
    assert delta.parts[0].tolist() == [130, 0, 8]
    assert delta.parts[1].view(torch.bfloat16).float().tolist() == [0.5, -3.0, 2.0]
