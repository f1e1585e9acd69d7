"""Megatron-Core on one CUDA device against the CPU stack that the rest of the suite checks.

- bf16 (and fp32) actor on CUDA against the fp32 CPU reference with the same weights (an HF file
  that both load the way the trainer loads a checkpoint): log-probs, entropy, the loss and gradient
  norm of one optimizer step, and log-probs after it. The layer spec on CUDA is Transformer
  Engine's when it imports, else the local one (printed either way).
- ``MegatronWorker.offload_to_cpu`` / ``reload_to_device``: device memory drops by the parameter
  and gradient bytes and comes back; parameters and log-probs are bit-exact after the round trip,
  gradients are zero, and the next optimizer step moves the parameters the model reads.

bf16 tolerance. bf16 keeps 8 significant bits: each rounding errs by at most u = 2^-8 ≈ 0.0039
relative. The forward rounds the weights once and then every GEMM output, norm, activation and
residual sum: about 10 roundings a layer, 4 layers, plus embedding and head, N ≈ 42. Independent
rounding errors add like a random walk, sqrt(N)·u ≈ 6.5u ≈ 0.025 relative on the logits; a log-prob
z_y - logsumexp(z) mostly cancels the shared part, leaving a few u relative to its own size. Bounds,
per valid response token, relative to max(1, |reference|): log-probs and entropy max ≤ 8u
(≈ 0.031), mean ≤ 2u; the gradient norm ≤ 8u; the loss ≤ 8u of its scale (sum of |logprob·adv|).
After one Adam step the bounds double (max ≤ 16u, mean ≤ 4u): the first step moves every weight by
±lr, the sign of its gradient, and bf16 flips the sign of gradients below its own noise, moving
those weights by 2·lr the other way. Measured with bf16 parameters on a CPU (same rounding, other
kernels): max 0.016 / mean 0.004 before the step, 0.029 / 0.008 after, gradient norm 0.012. Wrong
weights are far outside: a worker whose optimizer kept its own initialization (fp32 main
parameters not refreshed after the load) gave max 2.6 / mean 0.40 after the step.

fp32 tolerance: max 1e-3 relative before the step and for the gradient norm and loss, 5e-3 after
it, means a quarter of that. GEMMs summing in another order err by ~1e-6; the bound leaves room for
TF32 inside Transformer Engine's GEMMs (u = 2^-11) and stays 10x below a structural error.
"""

from __future__ import annotations

from typing import Any

import pytest
from gpu_env import gpu_only

pytestmark = gpu_only("megatron", "transformers", "safetensors")

U_BF16 = 2.0**-8
TOLERANCES = {
    # dtype: (max before, mean before, max after, mean after, grad norm, loss)
    "bfloat16": (8 * U_BF16, 2 * U_BF16, 16 * U_BF16, 4 * U_BF16, 8 * U_BF16, 8 * U_BF16),
    "float32": (1e-3, 2.5e-4, 5e-3, 1.25e-3, 1e-3, 1e-3),
}


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory) -> tuple[str, dict[str, Any]]:
    """The fp32 CPU run (CUDA hidden from its rank process) and the weights file it wrote."""
    import megatron_gpu_cases
    from dist_harness import run_ranks

    model_dir = str(tmp_path_factory.mktemp("tiny_llama_hf"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CUDA_VISIBLE_DEVICES", "")
        (reference,) = run_ranks(megatron_gpu_cases.cpu_reference, 1, model_dir, timeout_s=240)
    return model_dir, reference


def relative_errors(reference: dict[str, Any], other: dict[str, Any], name: str) -> tuple[float, float]:
    """(max, mean) over valid response tokens of |other - reference| / max(1, |reference|)."""
    import torch

    mask = torch.tensor(reference["mask"])
    ref = torch.tensor(reference[name], dtype=torch.float64)[mask]
    err = (torch.tensor(other[name], dtype=torch.float64)[mask] - ref).abs() / ref.abs().clamp(min=1.0)
    return float(err.max()), float(err.mean())


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_actor_on_cuda_matches_cpu_fp32(cpu_reference, dtype_name: str) -> None:
    import megatron_gpu_cases
    import torch
    from dist_harness import run_ranks

    model_dir, ref = cpu_reference
    (gpu,) = run_ranks(megatron_gpu_cases.gpu_actor, 1, model_dir, dtype_name, timeout_s=240)
    print(f"device: {gpu['device']}; layer spec: {gpu['spec']}; parameters: {gpu['param_dtype']}")
    assert gpu["param_dtype"] == f"torch.{dtype_name}" and ref["param_dtype"] == "torch.float32"
    assert not ref["skipped"] and not gpu["skipped"]
    max_before, mean_before, max_after, mean_after, grad_tol, loss_tol = TOLERANCES[dtype_name]
    errors = {name: relative_errors(ref, gpu, name) for name in ("logprobs", "entropy", "logprobs_after")}
    mask = torch.tensor(ref["mask"])
    loss_scale = float(
        (torch.tensor(ref["logprobs"]).abs() * torch.tensor(ref["advantages"]).abs())[mask].sum() / mask.sum()
    )
    grad_err = abs(gpu["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
    loss_err = abs(gpu["loss"] - ref["loss"]) / loss_scale
    print(f"{dtype_name} vs CPU fp32 (max, mean relative): {errors}")
    print(
        f"grad norm {gpu['grad_norm']:.6g} vs {ref['grad_norm']:.6g} (relative {grad_err:.3g}); "
        f"loss {gpu['loss']:.6g} vs {ref['loss']:.6g} ({loss_err:.3g} of its scale {loss_scale:.3g})"
    )
    for name in ("logprobs", "entropy"):
        assert errors[name][0] <= max_before and errors[name][1] <= mean_before, (name, errors[name])
    assert grad_err <= grad_tol, (gpu["grad_norm"], ref["grad_norm"])
    assert loss_err <= loss_tol, (gpu["loss"], ref["loss"])
    after = errors["logprobs_after"]
    assert after[0] <= max_after and after[1] <= mean_after, (
        f"log-probs after one step differ by {after} (max, mean) although the step's gradient agreed: "
        "the update did not start from the loaded weights (e.g. the optimizer's fp32 main parameters "
        "were not refreshed after the checkpoint load)"
    )


OFFLOAD_CASES = {
    "actor-distributed_optimizer": ("actor", True),
    "actor-plain_optimizer": ("actor", False),
    "reference": ("reference", False),
}


@pytest.mark.parametrize("case", list(OFFLOAD_CASES))
def test_offload_round_trip_is_bit_exact_and_frees_memory(case: str) -> None:
    """Slack on the memory: 1% or 1 MiB, whichever is larger (the allocator rounds each block to 512
    bytes; Megatron pads its buffers to bucket boundaries)."""
    import megatron_gpu_cases
    from dist_harness import run_ranks

    role, distributed = OFFLOAD_CASES[case]
    (out,) = run_ranks(megatron_gpu_cases.offload_round_trip, 1, role, distributed, timeout_s=240)
    print(f"layer spec: {out['spec']}; {out}")
    expected = out["expected_bytes"]
    slack = max(1 << 20, expected // 100)
    released = out["allocated"] - out["offloaded"]
    assert out["param_dtype"] == "torch.bfloat16" and expected > 30e6, out
    assert abs(released - expected) <= slack, (
        f"offload released {released / 2**20:.1f} MiB, parameters and grads hold {expected / 2**20:.1f} MiB"
    )
    assert abs(out["reloaded"] - out["allocated"]) <= slack, out
    assert out["params_on_device"] and out["params_bit_exact"] and out["logprobs_bit_exact"], out
    if role == "actor":
        assert out["grads_zero_after_reload"], out
        assert not out["step_after_reload_skipped"], out
        assert out["step_after_reload_moved_logprobs"] > 1e-3, out
        import torch

        # The step after the reload equals the same step in a run that never offloaded: a reload that
        # lost DDP's gradient hooks steps on zero gradients (grad norm 0.0) and Adam's moments alone.
        (twin,) = run_ranks(megatron_gpu_cases.offload_round_trip, 1, role, distributed, False, timeout_s=240)
        norm, twin_norm = out["step_after_reload_grad_norm"], twin["step_after_reload_grad_norm"]
        after = torch.tensor(out["logprobs_after_second_step"])
        twin_after = torch.tensor(twin["logprobs_after_second_step"])
        print(
            f"step after reload: grad norm {norm:.6g}, without offload {twin_norm:.6g}; "
            f"log-probs max abs difference {float((after - twin_after).abs().max()):.3g}"
        )
        assert twin_norm > 1.0 and abs(norm - twin_norm) <= 1e-3 * twin_norm, (norm, twin_norm)
        torch.testing.assert_close(after, twin_after, rtol=0, atol=1e-2)
