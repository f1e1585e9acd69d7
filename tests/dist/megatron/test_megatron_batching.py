"""Packed (THD) rows equal padded rows; dynamic micro-batches give the loss and gradient of fixed ones.

Runs one rank. Each variant computes logprobs, entropy, critic values, and the loss and gradient norm
of one train step at learning rate 0 (so all variants see the same weights). The forward-only passes
take micro-batches of their own size (``log_prob_micro_batch_size_per_gpu``,
``forward_micro_batch_size_per_gpu``) and give the same numbers.
"""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from megatron_cases import batching_case, forward_batching_case

pytestmark = pytest.mark.dist
TOL = 1e-5


def test_packed_and_dynamic_batches_match_padded_fixed() -> None:
    (result,) = run_ranks(batching_case, 1)
    print(result)
    assert result["num_micro_dynamic"] < result["num_micro_fixed"], "dynamic batching did not merge samples"
    assert result["grad_norm"] > 1e-3
    for name, diff in result.items():
        if not name.startswith(("num_", "grad_norm")):
            assert diff < TOL, f"{name}: max diff {diff:.3g} ≥ {TOL}"


def test_forward_passes_take_their_own_micro_batch_size() -> None:
    (result,) = run_ranks(forward_batching_case, 1)
    print(result)
    assert result["micro_batches_logprob"] == 1 and result["micro_batches_values"] == 1, result
    assert result["micro_batches_update"] == 6, result
    assert result["logprobs_diff"] < 1e-5 and result["values_diff"] < 1e-5, result
