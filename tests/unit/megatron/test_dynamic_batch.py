"""Micro-batch splits: every sample exactly once, token budget respected, clear error when impossible."""

from __future__ import annotations

import pytest

from rltrain.data.dynamic_batch import split_by_token_budget, split_fixed


def test_fixed_split_is_consecutive() -> None:
    assert split_fixed(5, 2) == [[0, 1], [2, 3], [4]]


def test_token_budget_first_fit_decreasing() -> None:
    lengths = [5, 9, 3, 7, 2, 6]
    splits = split_by_token_budget(lengths, 12)
    # 9+3, 7+5, 6+2 by first-fit decreasing.
    assert splits == [[1, 2], [0, 3], [4, 5]]
    assert sorted(i for s in splits for i in s) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in s) <= 12 for s in splits)


def test_token_budget_smaller_than_a_sequence_names_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"ppo_max_token_len_per_gpu=8 .* longest sequence \(9 tokens\)"):
        split_by_token_budget([3, 9], 8)
