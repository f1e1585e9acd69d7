"""Hand batches of the policy-loss tests: values placed at a batch's valid positions, garbage
elsewhere, and one loss evaluated with its gradient (shared by ``test_policy_losses.py`` and
``test_trust_region_losses.py``)."""

from __future__ import annotations

import torch

from rltrain.algo.loss_agg import LossAgg
from rltrain.algo.losses import PolicyLossInputs, PolicyLossOutput, PolicyLossParams, compute_policy_loss


def grid(
    valid: list[tuple[int, int]], shape: tuple[int, int], values: list[float], padding: float
) -> torch.Tensor:
    """float64 ``shape`` with ``values`` at the ``valid`` positions (in order), ``padding`` elsewhere."""
    out = torch.full(shape, padding, dtype=torch.float64)
    for (row, col), value in zip(valid, values, strict=True):
        out[row, col] = value
    return out


def run_loss(
    name: str, inputs: PolicyLossInputs, agg: LossAgg | None = None, **params: float
) -> tuple[PolicyLossOutput, torch.Tensor]:
    """The registered loss ``name`` on ``inputs`` (default aggregation: token-mean) and the gradient
    of its loss with respect to ``inputs.logprobs``."""
    out = compute_policy_loss(name, inputs, params=PolicyLossParams(**params), agg=agg or LossAgg())
    out.loss.backward()
    return out, inputs.logprobs.grad


def random_batch(seed: int) -> PolicyLossInputs:
    """Seven rows of five tokens of random log-probs and advantages, two rows empty, one with a gap."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [5, 0, 3, 1, 4, 0, 2]
    mask = torch.tensor([[1] * n + [0] * (5 - n) for n in lengths])
    mask[0, 2] = 0  # a gap
    old = -torch.rand(7, 5, generator=generator, dtype=torch.float64) * 2 - 0.1
    logprobs = old + torch.randn(7, 5, generator=generator, dtype=torch.float64) * 0.4
    advantages = torch.randn(7, 5, generator=generator, dtype=torch.float64)
    return PolicyLossInputs(old, logprobs.requires_grad_(), advantages, mask)


def _loss_on_rows(
    name: str, inputs: PolicyLossInputs, rows: slice, agg: LossAgg, params: PolicyLossParams
) -> tuple[PolicyLossOutput, torch.Tensor]:
    logprobs = inputs.logprobs.detach()[rows].clone().requires_grad_()
    part = PolicyLossInputs(
        inputs.old_logprobs[rows], logprobs, inputs.advantages[rows], inputs.response_mask[rows]
    )
    out = compute_policy_loss(name, part, params=params, agg=agg)
    out.loss.backward()
    return out, logprobs.grad


def split_vs_full(name: str, mode: str, params: PolicyLossParams, *, seed: int):
    """``(full output, full gradient, [(output, gradient)] of three micro-batches)`` of the loss on
    :func:`random_batch`, every part aggregated with the full batch's global counts."""
    inputs = random_batch(seed)
    mask = inputs.response_mask
    agg = LossAgg(
        mode=mode,
        global_num_tokens=int(mask.sum()),
        global_num_seqs=int((mask.sum(-1) > 0).sum()),
        loss_scale_factor=7.0,
    )
    full, full_grad = _loss_on_rows(name, inputs, slice(0, 7), agg, params)
    parts = [
        _loss_on_rows(name, inputs, rows, agg, params) for rows in (slice(0, 2), slice(2, 3), slice(3, 7))
    ]
    return full, full_grad, parts
