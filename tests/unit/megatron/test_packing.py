"""Sequence packing: real tokens only, per-sequence positions, and a map back to the padded layout."""

from __future__ import annotations

import torch

from rltrain.data.packing import pack_sequences, padded_position_ids


def test_pack_keeps_real_tokens_in_order_with_restarting_positions() -> None:
    input_ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 0, 0], [0, 9, 8, 7, 0]])
    mask = (input_ids != 0).long()
    packed = pack_sequences(input_ids, mask)
    assert packed.input_ids.tolist() == [[5, 6, 7, 1, 2, 3, 9, 8, 7]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1, 2]]
    assert packed.cu_seqlens.tolist() == [0, 3, 6, 9]
    assert packed.max_seqlen == 3 and packed.pad_tokens == 0
    assert packed.token_index.tolist() == [[-1, -1, 0, 1, 2], [3, 4, 5, -1, -1], [-1, 6, 7, 8, -1]]
    flat = input_ids.flatten()
    real = packed.token_index >= 0
    assert packed.input_ids[0, packed.token_index[real]].tolist() == flat[real.flatten()].tolist()


def test_pack_pads_to_a_multiple_and_a_minimum_length_as_its_own_segment() -> None:
    input_ids = torch.tensor([[4, 5, 6], [7, 0, 0]])
    packed = pack_sequences(input_ids, (input_ids != 0).long(), pad_to_multiple=4, min_length=6)
    assert packed.input_ids.tolist() == [[4, 5, 6, 7, 0, 0, 0, 0]]
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 8]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert packed.pad_tokens == 4


def test_padded_position_ids_count_real_tokens() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert padded_position_ids(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2]]
