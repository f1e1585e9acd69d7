"""The fused chunked LM head (``model.use_fused_kernels``, kernels/fused_logprob.py) through a real
Megatron actor: log-probs, entropy, loss, gradient norm and every parameter's gradient equal the
logits path's on the same weights (fp32, ≤ 1e-5) at DP=2, TP=2 with tied embeddings, TP=2 with
sequence parallelism and PP=2; packed micro-batches, chunks that do not divide the tokens."""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from fused_head_cases import LAYOUTS, fused_head_case

pytestmark = pytest.mark.dist


def test_fused_head_equals_the_logits_path() -> None:
    results = run_ranks(fused_head_case, 2)
    print(results[0])
    for result in results:
        for layout in LAYOUTS:
            for quantity in ("logprobs", "entropy", "loss", "grad_norm", "grads"):
                assert result[f"{layout}_{quantity}"] <= 1e-5, (layout, quantity, result)
            assert result[f"{layout}_grad_norm_value"] > 1e-3  # a real gradient was compared
            assert result[f"{layout}_head_restored"] == 1.0
