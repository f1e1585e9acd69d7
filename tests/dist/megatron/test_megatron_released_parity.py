"""The actor built from a released config (``tests/released``: GLM-4.5-Air, Kimi-K2-Instruct, shrunk)
computes the log-probs and entropies transformers computes on the same weights, fp32."""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from released_cases import CASES, released_parity_case

pytestmark = pytest.mark.dist


@pytest.mark.supports("glm4_moe", "hf_parity")
def test_released_configs_logprobs_match_transformers(tmp_path) -> None:
    (result,) = run_ranks(released_parity_case, 1, str(tmp_path))
    print(result)
    for name in CASES:
        assert result[f"{name}_scale"] > 1.0
        for field in ("logprobs", "entropy"):
            assert result[f"{name}_{field}"] < 1e-5, f"{name} {field}: {result[f'{name}_{field}']:.3g}"
