"""The CPU layer spec's packed attention equals Megatron's masked attention (values and gradients).

Runs one rank. Megatron's local ``DotProductAttention`` with the [tokens, tokens] block-diagonal causal
mask (the path packed rows took before) is the reference, with grouped-query heads and query-key layer
scaling on; ``tests/unit/megatron/test_packed_attention.py`` holds the memory test.
"""

from __future__ import annotations

import math

import pytest
from dist_harness import run_ranks
from packed_attention_cases import DIM, packed_attention_case

pytestmark = pytest.mark.dist


def test_packed_attention_matches_megatron_masked_attention() -> None:
    (result,) = run_ranks(packed_attention_case, 1)
    print(result)
    assert result["scale"] == pytest.approx(1 / math.sqrt(DIM))
    assert result["dq_scale"] > 0.1
    for name in ("out", "dq", "dk", "dv"):
        assert result[name] <= 1e-6, f"{name}: max diff {result[name]:.3g}"
