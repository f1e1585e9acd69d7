"""Context parallelism against CP=1 on the same packed ragged batch and weights (four gloo ranks).

CP=2 (DP=2), CP=2 with dynamic batch size, CP=2×TP=2 with sequence parallelism, CP=2×PP=2, and the
critic (CP=2, CP=2×TP=2 dynamic) and reward model (CP=2) against a CP=1 (DP=4) run: outputs before
and after one optimizer step, both steps' losses and gradient norms, and (TP=PP=1) every parameter
after the first step, within 1e-5 (relative to the output's scale when above 1).
"""

from __future__ import annotations

import pytest
import torch
from cp_cases import cp_case
from dist_harness import run_ranks
from megatron_fixtures import tiny_mixtral

from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.model_config import transformer_config_from_hf

pytestmark = pytest.mark.dist
TOL = 1e-5


@pytest.mark.supports("llama", "cp")
def test_context_parallel_matches_single_rank(tmp_path) -> None:
    results = run_ranks(cp_case, 4, str(tmp_path), timeout_s=600)
    for rank, layouts in enumerate(results):
        print(f"rank {rank}: {layouts}")
        sanity = layouts.pop("sanity")
        assert sanity["num_micro_dynamic"] == 2, "the dynamic split did not make several micro-batches"
        assert sanity["values_changed"] > 1e-4, "the optimizer step did not change the critic"
        for layout, diffs in layouts.items():
            for name, diff in diffs.items():
                assert diff < TOL, f"rank {rank} {layout} {name}: max diff {diff:.3g} ≥ {TOL}"


@pytest.mark.supports("mixtral", "cp", refused=True)
def test_moe_with_context_parallelism_is_refused_naming_the_key() -> None:
    # The router's auxiliary loss would see one CP rank's tokens, not the sequence's.
    with pytest.raises(NotImplementedError, match=r"mixtral: parallel.context_parallel_size=2 with MoE"):
        transformer_config_from_hf(
            tiny_mixtral(), parallel=ParallelConfig(context_parallel_size=2), params_dtype=torch.float32
        )
