"""Masked reductions against plain-Python computations over the valid entries."""

import math
import statistics

import pytest
import torch

from rltrain.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten

VALUES = torch.tensor(
    [[1.0, 2.0, 3.0, 1e6], [4.0, -5.0, 1e6, 1e6], [0.5, 1e6, 1e6, 1e6]], dtype=torch.float64
)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
VALID = [1.0, 2.0, 3.0, 4.0, -5.0, 0.5]  # the unmasked entries, row by row


def test_masked_sum_and_mean_ignore_padding():
    assert masked_sum(VALUES, MASK).item() == pytest.approx(sum(VALID))
    assert masked_mean(VALUES, MASK).item() == pytest.approx(sum(VALID) / len(VALID))


def test_masked_reductions_along_a_dim():
    assert masked_sum(VALUES, MASK, dim=-1).tolist() == pytest.approx([6.0, -1.0, 0.5])
    assert masked_mean(VALUES, MASK, dim=-1).tolist() == pytest.approx([2.0, -0.5, 0.5])


def test_masked_mean_with_explicit_denominator():
    assert masked_mean(VALUES, MASK, denominator=10).item() == pytest.approx(sum(VALID) / 10)
    per_row = masked_mean(
        VALUES, MASK, dim=-1, denominator=torch.tensor([2.0, 4.0, 1.0], dtype=torch.float64)
    )
    assert per_row.tolist() == pytest.approx([3.0, -0.25, 0.5])


def test_masked_mean_of_nothing_is_zero():
    assert masked_mean(VALUES, torch.zeros_like(MASK)).item() == 0.0


def test_bool_and_float_masks_agree():
    expected = masked_mean(VALUES, MASK).item()
    assert masked_mean(VALUES, MASK.bool()).item() == pytest.approx(expected)
    assert masked_mean(VALUES, MASK.double()).item() == pytest.approx(expected)


def test_masked_var_unbiased_and_biased():
    assert masked_var(VALUES, MASK).item() == pytest.approx(statistics.variance(VALID))
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(statistics.pvariance(VALID))


def test_unbiased_var_needs_two_entries():
    one = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="at least 2 valid entries, the mask has 1"):
        masked_var(VALUES, one)


def test_masked_whiten_matches_plain_formula():
    mean = statistics.fmean(VALID)
    scale = 1.0 / math.sqrt(statistics.variance(VALID) + 1e-8)
    whitened = masked_whiten(VALUES, MASK)
    got = whitened[MASK.bool()].tolist()
    assert got == pytest.approx([(v - mean) * scale for v in VALID], rel=1e-12)
    # whitened valid entries have mean 0 and unbiased variance ~1
    assert statistics.fmean(got) == pytest.approx(0.0, abs=1e-12)
    assert statistics.variance(got) == pytest.approx(1.0, rel=1e-6)


def test_masked_whiten_without_mean_shift_keeps_the_mean():
    mean = statistics.fmean(VALID)
    scale = 1.0 / math.sqrt(statistics.variance(VALID) + 1e-8)
    got = masked_whiten(VALUES, MASK, shift_mean=False)[MASK.bool()].tolist()
    assert got == pytest.approx([(v - mean) * scale + mean for v in VALID], rel=1e-12)
