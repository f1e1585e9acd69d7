"""Triton versions of ``kernels/fused_logprob.py``'s per-chunk pieces (``impl="triton"``, CUDA only).

Imported only when ``fused_logprobs_entropy(..., impl="triton")`` is called: the package imports
without triton. The matmuls, the chunk loop and the TP reductions stay in ``fused_logprob.py``; these
kernels replace the two memory-bound steps on one chunk of logits [chunk, valid] (input dtype):

* ``chunk_stats``: one program per row, two passes over the row in blocks of ``BLOCK_V`` columns
  (the max, then Σ exp(z - m), Σ exp(z - m)(z - m) and the target logit); per-lane accumulators,
  float32 throughout, so no online rescaling is needed.
* ``chunk_grad``: one program per (row, block of columns) forms the softmax gradient of
  ``grad_logprobs · logprob + grad_entropy · entropy`` and writes it over the logits in place.

Same formulas and return values as the torch functions of the same names (their docstrings), except
that the temperature is applied as a multiplication by its reciprocal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024
"""Columns one program handles at a time."""

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _stats_kernel(
    logits_ptr,
    targets_ptr,
    out_ptr,
    num_cols,
    row_stride,
    out_stride,
    inv_temperature,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    cols = tl.arange(0, BLOCK)
    target = tl.load(targets_ptr + row)  # -1 when the target is not on this rank
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, num_cols, BLOCK):
        idx = start + cols
        mask = idx < num_cols
        z = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32) * inv_temperature
        lane_max = tl.maximum(lane_max, tl.where(mask, z, float("-inf")))
    m = tl.max(lane_max, axis=0)
    lane_a = tl.zeros([BLOCK], tl.float32)
    lane_b = tl.zeros([BLOCK], tl.float32)
    lane_t = tl.zeros([BLOCK], tl.float32)
    for start in range(0, num_cols, BLOCK):
        idx = start + cols
        mask = idx < num_cols
        z = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32) * inv_temperature
        shifted = tl.where(mask, z - m, 0.0)
        e = tl.where(mask, tl.exp(shifted), 0.0)
        lane_a = lane_a + e
        lane_b = lane_b + e * shifted
        lane_t = lane_t + tl.where(mask & (idx == target), z, 0.0)
    tl.store(out_ptr + row, m)
    tl.store(out_ptr + out_stride + row, tl.sum(lane_a, axis=0))
    tl.store(out_ptr + 2 * out_stride + row, tl.sum(lane_b, axis=0))
    tl.store(out_ptr + 3 * out_stride + row, tl.sum(lane_t, axis=0))


@triton.jit
def _grad_kernel(
    logits_ptr,
    targets_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logprobs_ptr,
    grad_entropy_ptr,
    num_cols,
    row_stride,
    inv_temperature,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < num_cols
    ptrs = logits_ptr + row * row_stride + idx
    z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * inv_temperature
    target = tl.load(targets_ptr + row)
    lse = tl.load(lse_ptr + row)
    entropy = tl.load(entropy_ptr + row)
    g_lp = tl.load(grad_logprobs_ptr + row)
    g_ent = tl.load(grad_entropy_ptr + row)
    log_p = z - lse
    p = tl.exp(log_p)
    # d logprob / dz = onehot - p ;  d entropy / dz = -p (log p + H) ;  dz / dlogits = 1 / T
    grad = -g_ent * p * (log_p + entropy) - g_lp * p + tl.where(idx == target, g_lp, 0.0)
    grad = grad * inv_temperature
    tl.store(ptrs, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def _check(logits: torch.Tensor) -> None:
    if not logits.is_cuda or logits.dtype not in SUPPORTED_DTYPES or logits.stride(-1) != 1:
        raise ValueError(
            f"triton chunk kernels need CUDA logits of {SUPPORTED_DTYPES} with unit column stride, got "
            f"{logits.dtype} on {logits.device} with strides {logits.stride()}"
        )


def chunk_stats(logits: torch.Tensor, local_targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits: [chunk, valid], local_targets: [chunk] (-1: not here) → [4, chunk] float32 (m, a, b, t)."""
    _check(logits)
    rows, cols = logits.shape
    out = torch.empty(4, rows, dtype=torch.float32, device=logits.device)
    if rows:
        _stats_kernel[(rows,)](
            logits,
            local_targets.contiguous(),
            out,
            cols,
            logits.stride(0),
            out.stride(0),
            1.0 / temperature,
            BLOCK=BLOCK_V,
        )
    return out


def chunk_grad(
    logits: torch.Tensor,
    local_targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """d(loss)/d(logits) for one chunk, [chunk, valid] in ``logits.dtype``, written over ``logits``."""
    _check(logits)
    rows, cols = logits.shape
    if rows:
        vectors = [v.to(torch.float32).contiguous() for v in (lse, entropy, grad_logprobs, grad_entropy)]
        _grad_kernel[(rows, triton.cdiv(cols, BLOCK_V))](
            logits,
            local_targets.contiguous(),
            *vectors,
            cols,
            logits.stride(0),
            1.0 / temperature,
            BLOCK=BLOCK_V,
        )
    return logits
