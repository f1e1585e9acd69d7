"""Vocab-parallel logprobs and entropy (and their gradients) equal the full-vocabulary computation,
also when the vocabulary is padded to a multiple of TP."""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from megatron_cases import vocab_parallel_case

pytestmark = pytest.mark.dist


def test_vocab_parallel_logprobs_match_full_log_softmax() -> None:
    for rank, result in enumerate(run_ranks(vocab_parallel_case, 2)):
        print(f"rank {rank}: {result}")
        assert result["local_vocab"] == 32
        for name, diff in result.items():
            if name != "local_vocab":
                assert diff < 1e-5, f"rank {rank} {name}: {diff:.3g}"
