"""Vocab-parallel logprobs and entropy (and their gradients) equal the full-vocabulary computation."""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from megatron_cases import vocab_parallel_case

pytestmark = pytest.mark.dist


def test_vocab_parallel_logprobs_match_full_log_softmax() -> None:
    for rank, result in enumerate(run_ranks(vocab_parallel_case, 2)):
        print(f"rank {rank}: {result}")
        assert result["local_vocab"] == 32
        for name in ("logprobs", "entropy", "grad"):
            assert result[name] < 1e-5, f"rank {rank} {name}: {result[name]:.3g}"
