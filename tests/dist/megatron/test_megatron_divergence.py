"""The train step's divergence guard and the weight sync's refusal, on a real Megatron model at TP=2.

A finite gradient times lr=1e9 leaves finite but wrecked weights: the step reports their largest
magnitude over both ranks (the driver's ``trainer.max_param_abs`` bound then stops the run). When
the update overflows float32 (decoupled decay 1 - lr·wd = -3e39) both ranks raise, naming the first
parameter (the embedding is decayed and comes first; rank 0 holds the first half of the vocabulary). A NaN in one rank's shard makes the export refuse on both ranks before anything
is sent, naming that parameter and rank.
"""

from __future__ import annotations

import re

import pytest
from dist_harness import run_ranks
from divergence_cases import WEIGHT_DECAY, divergence_case

pytestmark = pytest.mark.dist


def test_huge_weights_are_reported_infinite_ones_stop_and_the_sync_refuses_nan() -> None:
    ranks = run_ranks(divergence_case, 2)
    lr = 1e9
    before = max(r["huge_before_local_max"] for r in ranks)
    after = max(r["huge_local_max"] for r in ranks)
    for r in ranks:
        assert r["huge_skipped"] is False
        # the reported magnitude is both ranks' largest parameter element
        assert r["huge_reported"] == after
    # Adam's first step moves each element by lr·g/(|g|+eps) (bias corrections cancel), decoupled
    # decay scales it by 1 - lr·wd: |p'| <= lr·wd·|p| + lr, and some element moves by ~lr
    assert lr * (1 - 1e-3) <= after <= lr * WEIGHT_DECAY * before + lr * (1 + 1e-6)

    message = ranks[0]["infinite"]
    assert ranks[1]["infinite"] == message
    assert re.fullmatch(
        r"actor diverged: parameter embedding\.word_embeddings\.weight \(rank 0\) is not finite after an "
        r"optimizer step \(gradient norm [0-9.e+-]+, lr 3e\+37\); stopped before it reaches the engines or "
        r"a checkpoint",
        message,
    ), message

    assert ranks[0]["finite_sync_tensors"] > 0 and ranks[1]["finite_sync_tensors"] == 0
    for r in ranks:
        assert r["nan_sync"] == (
            "weight sync refused: parameter decoder.layers.1.mlp.linear_fc2.weight (trainer rank 1) holds "
            "NaN or infinite values; the engines keep their weights"
        )
