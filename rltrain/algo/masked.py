"""Reductions over the valid (mask == 1) entries of a tensor.

Contract: ``mask`` is a 0/1 tensor (bool, integer or float) broadcastable to ``values``; masked-out
entries never influence a result, whatever they hold (NaN aside: ``0 * NaN`` is NaN, so callers
keep padding finite). Means divide by the number of valid entries, or by an explicit
``denominator`` that the caller computes over the whole global batch, so that per-micro-batch
results add up to the global value.

Departure from verl: ``masked_mean`` of an all-masked tensor is 0 (the count is clamped to 1) rather
than ``sum / (count + 1e-8)``; for a non-empty mask the result is the exact mean, without the 1e-8
bias.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1.

    Args:
        values: ``[batch, response_len]`` (any shape).
        mask: same shape as ``values`` (or broadcastable), 0/1.
        dim: reduce only this dimension; ``None`` reduces everything to a scalar.

    Returns:
        A scalar, or ``values`` with ``dim`` removed (e.g. ``[batch]`` for ``dim=-1``).
    """
    masked = values * mask.to(values.dtype)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    dim: int | None = None,
    *,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean of ``values`` over valid entries, or ``masked_sum / denominator`` when one is given.

    Args:
        values: ``[batch, response_len]`` (any shape).
        mask: same shape as ``values`` (or broadcastable), 0/1.
        dim: reduce only this dimension; ``None`` reduces everything to a scalar.
        denominator: explicit divisor (e.g. the global number of valid tokens); when ``None`` the
            local count of valid entries is used, clamped to at least 1.

    Returns:
        A scalar, or ``values`` with ``dim`` removed.
    """
    total = masked_sum(values, mask, dim)
    if denominator is None:
        count = masked_sum(torch.ones_like(values), mask, dim)
        return total / count.clamp(min=1)
    return total / denominator


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over all valid entries (a scalar).

    Args:
        values: ``[batch, response_len]`` (any shape).
        mask: same shape as ``values``, 0/1.
        unbiased: apply Bessel's correction ``n / (n - 1)`` as verl does; needs at least two valid
            entries.

    Returns:
        A scalar tensor.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = int(mask.sum().item())
        if count < 2:
            raise ValueError(f"unbiased masked_var needs at least 2 valid entries, the mask has {count}")
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalize ``values`` to unit (unbiased) variance over valid entries.

    ``(values - mean) / sqrt(var + eps)``; with ``shift_mean=False`` the mean is added back, so only
    the scale changes. Masked-out entries are transformed too (not zeroed); callers that need zeros
    there multiply by the mask.

    Args:
        values: ``[batch, response_len]`` (any shape).
        mask: same shape as ``values``, 0/1, with at least two valid entries.
        shift_mean: subtract the mean (``True``) or keep it.
        eps: added to the variance before the square root.

    Returns:
        Same shape as ``values``.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
