"""TP=2 (with and without sequence parallelism) against TP=1, DP=2 on the same weights, two gloo ranks.

``use_cpu_initialization`` gives the same full weights at any TP for the same seed. The TP=1 run
splits the batch over two data-parallel ranks while TP=2 gives both ranks the whole batch, so equal
losses and gradient norms also check that the loss is independent of the data-parallel split.
"""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from megatron_cases import tp2_case

pytestmark = pytest.mark.dist
TOL = 1e-5


@pytest.mark.supports("llama", "tp")
def test_tp2_matches_single_rank() -> None:
    results = run_ranks(tp2_case, 2)
    for rank, diffs in enumerate(results):
        print(f"rank {rank}: {diffs}")
        assert diffs["sanity"]["loss_changed"] > 1e-4, "the optimizer step did not change the critic"
        for role in ("actor", "actor_sp_padded", "critic", "critic_sp"):
            for name, diff in diffs[role].items():
                assert diff < TOL, f"rank {rank} {role} {name}: max diff {diff:.3g} ≥ {TOL}"
