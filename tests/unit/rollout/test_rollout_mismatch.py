"""Mismatch metrics against hand-computed numbers."""

import math

import pytest
import torch

from rltrain.rollout.mismatch import logprob_mismatch

TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, 0.0, 0.0]])
ROLLOUT = torch.tensor([[-1.5, -2.0, -0.25], [-0.1, 9.0, 9.0]])  # masked entries are far off on purpose
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_hand_numbers():
    # valid diffs: 0.5, 0, -0.25, 0
    m = logprob_mismatch(TRAINER, ROLLOUT, MASK, tis_cap=1.5)
    assert m["rollout/logprob_abs_diff_mean"] == pytest.approx(0.75 / 4)
    assert m["rollout/logprob_abs_diff_max"] == pytest.approx(0.5)
    ratio_mean = (math.exp(0.5) + 1.0 + math.exp(-0.25) + 1.0) / 4
    assert m["rollout/importance_ratio_mean"] == pytest.approx(ratio_mean, rel=1e-12)
    assert ratio_mean == pytest.approx(1.10688051345, rel=1e-9)
    assert m["rollout/importance_ratio_capped_frac"] == pytest.approx(0.25)


def test_global_denominator_makes_split_batches_add_up():
    whole = logprob_mismatch(TRAINER, ROLLOUT, MASK)
    parts = [
        logprob_mismatch(TRAINER[i : i + 1], ROLLOUT[i : i + 1], MASK[i : i + 1], num_valid_tokens=4)
        for i in (0, 1)
    ]
    for key in ("rollout/logprob_abs_diff_mean", "rollout/importance_ratio_mean"):
        assert sum(p[key] for p in parts) == pytest.approx(whole[key], rel=1e-12)


def test_identical_logprobs_and_empty_mask():
    same = logprob_mismatch(TRAINER, TRAINER, MASK, prefix="")
    assert same == {"logprob_abs_diff_mean": 0.0, "logprob_abs_diff_max": 0.0, "importance_ratio_mean": 1.0}
    empty = logprob_mismatch(TRAINER, ROLLOUT, torch.zeros_like(MASK), prefix="")
    assert empty["logprob_abs_diff_max"] == 0.0 and empty["importance_ratio_mean"] == 0.0


def test_shape_mismatch_names_shapes():
    with pytest.raises(ValueError, match=r"rollout_logprobs \(2, 2\)"):
        logprob_mismatch(TRAINER, ROLLOUT[:, :2], MASK)
