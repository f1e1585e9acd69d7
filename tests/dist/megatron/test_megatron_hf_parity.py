"""The Megatron model built from an HF config computes what HF transformers computes (same weights).

An independent reference for the config translation: RoPE base, RMSNorm eps, SwiGLU, GQA, Q/K/V
biases (Qwen2) and the response-token alignment of the logprobs.
"""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from megatron_cases import hf_parity_case

pytestmark = pytest.mark.dist


def test_logprobs_match_hf_transformers() -> None:
    (result,) = run_ranks(hf_parity_case, 1)
    print(result)
    for name in ("llama", "qwen2"):
        assert result[f"{name}_scale"] > 1.0
        for field in ("logprobs", "entropy"):
            assert result[f"{name}_{field}"] < 1e-5, f"{name} {field}: {result[f'{name}_{field}']:.3g}"
