"""Rollout correction at data-parallel size 2 equals the single-rank run of the same batch.

A real actor (``PolicyWorker``, tiny llama, Megatron on gloo, distributed optimizer) takes two
optimizer steps through the torchrun mode's role handle, with token IS (threshold 1.5) and rejection
(``token_k1`` + ``seq_max_k2``) that drops 2 tokens of mini-batch 0 and two whole rows of
mini-batch 1 (one of them every token of it), chosen by hand in ``rollout_correction_cases``. At
DP=2 each rank sees half of each mini-batch, and the outliers sit on both ranks (the largest weight
of each mini-batch on rank 1 only), so the ``rollout_corr/*`` metrics and the kept-token
denominators of the loss are right only when the statistics are reduced over the data-parallel group.

References: the metrics of the single rank against their definitions computed here from the
hand-written log-ratios; its loss, gradient norm and updated weights against the same update
without rejection on a batch whose response mask is the hand-written keep mask; DP=2 against the
single rank.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import run_ranks
from rollout_correction_cases import (
    IS_THRESHOLD,
    KEEP,
    LOG_RATIO,
    MINI_BATCH,
    RESPONSE_LENGTHS,
    correction_case,
)

from rltrain.logging import metrics as mk

pytestmark = pytest.mark.dist

METRIC_TOL = 2e-6
"""Single rank vs definitions: ℓ reaches the correction as ``old - (old - ℓ)`` in float32 (log-probs
near -6: an ulp is 5e-7)."""
DP_METRIC_TOL = 1e-12
"""DP=2 vs one rank, ``rollout_corr/*``: float64 sums of the same values, added in another order."""
DP_TRAIN_TOL = 1e-5
"""DP=2 vs one rank, losses, gradient norm (relative) and log-probs after the steps: float32
gradients reduced over the ranks in another order (measured: 2e-7 relative, 5e-7 on log-probs)."""


def _expected_metrics(rows: slice) -> dict[str, float]:
    """``rollout_corr/*`` of one mini-batch from the definitions (the names documented in
    ``rltrain.logging.metrics``)."""
    valid = torch.zeros_like(LOG_RATIO, dtype=torch.bool)
    for row, length in enumerate(RESPONSE_LENGTHS):
        valid[row, :length] = True
    valid, keep, ell = valid[rows], KEEP[rows].bool(), LOG_RATIO[rows]
    tokens = ell[valid]
    ratio = tokens.exp()
    weights = ratio.clamp(max=IS_THRESHOLD)
    n = tokens.numel()
    rows_with_tokens = valid.any(-1)
    return {
        mk.ROLLOUT_CORR_KL: float(-tokens.sum() / n),
        mk.ROLLOUT_CORR_K3_KL: float((ratio - 1 - tokens).sum() / n),
        mk.ROLLOUT_CORR_CHI2_TOKEN: float((ratio**2).sum() / n - 1),
        mk.ROLLOUT_CORR_IS_MEAN: float(weights.sum() / n),
        mk.ROLLOUT_CORR_IS_MAX: float(weights.max()),
        mk.ROLLOUT_CORR_IS_MIN: float(weights.min()),
        mk.ROLLOUT_CORR_IS_ESS: float(weights.sum() ** 2 / (n * (weights**2).sum())),
        mk.ROLLOUT_CORR_IS_FRACTION_HIGH: float((ratio > IS_THRESHOLD).sum() / n),
        mk.ROLLOUT_CORR_RS_MASKED_FRACTION: 1 - float(keep[valid].sum()) / n,
        mk.ROLLOUT_CORR_RS_SEQ_MASKED_FRACTION: float((valid & ~keep).any(-1).sum())
        / float(rows_with_tokens.sum()),
    }


def _valid_mask() -> torch.Tensor:
    valid = torch.zeros(LOG_RATIO.shape)
    for row, length in enumerate(RESPONSE_LENGTHS):
        valid[row, :length] = 1
    return valid


def test_rollout_correction_at_dp2_equals_one_rank(model_dir) -> None:
    (one,) = run_ranks(correction_case, 1, str(model_dir), True)
    two = run_ranks(correction_case, 2, str(model_dir), False)
    for run in (one, one["reference"], *two):
        for key in ("old_logprobs", "logprobs_after"):
            run[key] = torch.from_numpy(run[key])
    assert one["dp_size"] == 1 and [r["dp_size"] for r in two] == [2, 2]
    valid = _valid_mask()

    # the single rank: rollout_corr/* against the definitions; rejection really drops tokens
    for step, rows in enumerate([slice(0, MINI_BATCH), slice(MINI_BATCH, 2 * MINI_BATCH)]):
        expected = _expected_metrics(rows)
        got = {k: v for k, v in one["steps"][step].items() if k.startswith("rollout_corr/")}
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert math.isclose(got[key], value, rel_tol=0, abs_tol=METRIC_TOL), (step, key, got[key], value)
    assert [s[mk.ROLLOUT_CORR_RS_MASKED_FRACTION] for s in one["steps"]] == pytest.approx([2 / 21, 5 / 16])
    assert one["steps"][1][mk.ROLLOUT_CORR_IS_MAX] == IS_THRESHOLD

    # the single rank's update equals training on the kept tokens alone (same token IS weights)
    reference = one["reference"]
    for step, ref_step in zip(one["steps"], reference["steps"]):
        for key, value in ref_step.items():
            assert step[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    kept_diff = ((one["logprobs_after"] - reference["logprobs_after"]).abs() * KEEP).max()
    moved = ((one["logprobs_after"] - one["old_logprobs"]).abs() * valid).max()
    assert kept_diff <= 1e-6 < 1e-2 < moved

    # DP=2: the same log-probs going in, the same metrics, losses, gradients and weights coming out
    for rank in two:
        assert torch.equal(rank["old_logprobs"], one["old_logprobs"])
    assert len(two[0]["steps"]) == len(one["steps"]) == 2  # rank 0's metrics, as the role reports them
    for dp_step, step in zip(two[0]["steps"], one["steps"]):
        assert dp_step.keys() == step.keys()
        for key, value in step.items():
            tol = DP_METRIC_TOL if key.startswith("rollout_corr/") else DP_TRAIN_TOL * max(1.0, abs(value))
            assert abs(dp_step[key] - value) <= tol, (key, dp_step[key], value)
    for rank in two:  # each rank's own copy of the updated weights
        after_diff = ((rank["logprobs_after"] - one["logprobs_after"]).abs() * valid).max()
        assert after_diff <= DP_TRAIN_TOL, after_diff
