"""Conversion's verification compares like with like and still catches a wrong conversion.

A bf16 checkpoint converts and verifies by default: Megatron and transformers both run in bf16 and
the logits are held to ``atol`` plus three times what bf16 rounding alone moves transformers' own
logits (recomputed here from transformers directly). A conversion that is wrong in a way the
bit-exact round trip cannot see (gate and up projections swapped both ways, injected into the
spawned ranks) fails at bf16 and at fp32 and leaves nothing at the destination, nor a staging
directory. The probe's hundreds of tokens catch a dropped RoPE scaling that 2×16 tokens miss in bf16.
"""

from __future__ import annotations

import re
from pathlib import Path

import bridge_ranks
import pytest
import torch
from dist_harness import run_ranks

from megatron_bridge.dcp_io import DistCheckpointReader
from megatron_bridge.verify import PROBE_TOKENS, ROUNDING_NOISE_FACTOR, hf_logits, probe_batch
from rltrain.convert import launch
from rltrain.convert.launch import run_conversion
from rltrain.convert.report import ConversionError
from rltrain.models.tiny import build_tiny_model, save_pretrained_with_tokenizer

pytestmark = pytest.mark.dist

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,  # Megatron's fixed llama3 constant
}


def _save_tiny(out: Path, model_type: str, dtype: torch.dtype, **overrides) -> Path:
    model, tokenizer = build_tiny_model(model_type, seed=0, **overrides)
    model = model.to(dtype)
    model.config.dtype = dtype
    return save_pretrained_with_tokenizer(model, tokenizer, out)


@pytest.fixture(scope="module")
def bf16_conversion(tmp_path_factory):
    """A bf16 qwen2 converted with the default verification into a directory holding a stale shard."""
    root = tmp_path_factory.mktemp("bf16")
    src = _save_tiny(root / "hf", "qwen2", torch.bfloat16)
    dst = root / "mcore"
    dst.mkdir()
    (dst / "model-00001-of-00002.safetensors").write_text("stale")
    return src, dst, run_conversion("hf-to-mcore", src, dst, overwrite=True)


def test_a_bf16_checkpoint_converts_and_verifies_by_default(bf16_conversion):
    src, dst, report = bf16_conversion
    assert report.bit_exact_tensors == 26
    ids = probe_batch(448, max_positions=512)
    noise = (hf_logits(src, ids, dtype=torch.bfloat16) - hf_logits(src, ids)).abs().max().item()
    assert noise > 1e-3  # bf16 rounding alone moves the logits far beyond fp32's atol
    assert report.logits_tolerance == pytest.approx(1e-4 + ROUNDING_NOISE_FACTOR * noise)
    assert 0 < report.max_abs_logit_diff <= report.logits_tolerance
    assert report.logits_check == (
        f"logits vs transformers, both in bfloat16 on 2×{PROBE_TOKENS} tokens: max abs diff "
        f"{report.max_abs_logit_diff:.3e} <= tolerance {report.logits_tolerance:.3e} (atol 0.0001 + 3 × "
        f"{noise:.3e}, the most that running in bfloat16 instead of float32 moves transformers' own logits)"
    )
    assert report.logits_check in report.summary()
    step = DistCheckpointReader(dst / "step_0")
    assert step.dtype("embedding.word_embeddings.weight") == torch.bfloat16


def test_overwrite_cleared_the_destination_and_no_staging_is_left(bf16_conversion):
    _, dst, _ = bf16_conversion
    assert sorted(p.name for p in dst.iterdir()) == ["hf", "latest", "step_0"]
    assert sorted(p.name for p in dst.parent.iterdir()) == ["hf", "mcore"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_wrong_conversion_fails_verification_and_leaves_nothing(tmp_path, monkeypatch, dtype):
    src = _save_tiny(tmp_path / "hf", "llama", dtype, init_std=0.1)
    monkeypatch.setattr(launch, "_entry", bridge_ranks.entry_with_gate_and_up_swapped)
    dst = tmp_path / "mcore"
    with pytest.raises(ConversionError) as failed:
        run_conversion("hf-to-mcore", src, dst)
    name = str(dtype).removeprefix("torch.")
    found = re.fullmatch(
        rf"rank 0: the converted model's logits vs transformers, both in {name} on 2×{PROBE_TOKENS} tokens: "
        rf"max abs diff (\S+) > (?:atol|tolerance) (\S+)(?: \(.*\))?; nothing was written to {dst}",
        str(failed.value),
    )
    assert found, str(failed.value)
    assert float(found.group(1)) > 3 * float(found.group(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no dst, no staging directory


def test_the_probe_is_long_enough_to_see_rope_scaling(tmp_path):
    dirs = [
        _save_tiny(tmp_path / str(dtype), "llama", dtype, init_std=0.1, rope_parameters=LLAMA3_ROPE)
        for dtype in (torch.bfloat16, torch.float32)
    ]
    (results,) = run_ranks(bridge_ranks.rope_probe_checks, 1, [str(d) for d in dirs], [16, PROBE_TOKENS])
    for dtype in ("torch.bfloat16", "torch.float32"):
        diff, tolerance = results[(dtype, "as saved", PROBE_TOKENS)]
        assert diff <= tolerance, (dtype, diff, tolerance)
        for wrong in ("scaling dropped", "theta halved"):
            diff, tolerance = results[(dtype, wrong, PROBE_TOKENS)]
            assert diff > tolerance, (dtype, wrong, diff, tolerance)
    diff, tolerance = results[("torch.bfloat16", "scaling dropped", 16)]
    assert diff <= tolerance, (diff, tolerance)  # what the former 2×16-token probe let through
