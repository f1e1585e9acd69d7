"""Losses of the PPO family: policy (clipped surrogate), value, entropy, KL.

Every loss turns a per-token matrix ``[batch, response_len]`` into a scalar with a
:class:`~rltrain.algo.loss_agg.LossAgg` (verl's ``loss_agg_mode`` with the mini-batch's global
denominators, :mod:`rltrain.algo.loss_agg`), so that summing a micro-batch's loss over micro-batches
and ranks gives exactly the loss of the full mini-batch, however it was split.

Policy losses are registered in ``POLICY_LOSSES`` (verl's ``policy_loss.loss_mode``; the losses other
than ``vanilla`` live in :mod:`rltrain.algo.policy_losses` and
:mod:`rltrain.algo.trust_region_losses`, registered when ``rltrain.algo`` is imported); ``vanilla``
is PPO's clipped surrogate (Schulman et al. 2017) with asymmetric clip ranges (DAPO's
``clip_ratio_low/high``), dual-clip for negative advantages (Ye et al. 2020, ``clip_ratio_c``) and an
optional truncated importance-sampling correction (TIS, Yao et al. 2025) for the gap between the
rollout engine's and the trainer's log-probs. Metrics are detached 0-dim tensors (no host sync),
averaged over valid tokens with the same token denominator as ``token-mean``: with
``global_num_tokens`` they too add up over micro-batches to the mini-batch mean.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rltrain.algo import rollout_correction
from rltrain.algo.kl import kl_penalty
from rltrain.algo.loss_agg import LossAgg
from rltrain.algo.registry import Registry


@dataclass
class PolicyLossInputs:
    """Per-token tensors of one micro-batch for the policy loss."""

    old_logprobs: torch.Tensor
    """``[batch, response_len]`` log-probs of the policy that sampled the data, as recomputed by the
    trainer before the update (no gradient)."""

    logprobs: torch.Tensor
    """``[batch, response_len]`` log-probs of the current policy (carries the gradient)."""

    advantages: torch.Tensor
    """``[batch, response_len]`` advantages (no gradient)."""

    response_mask: torch.Tensor
    """``[batch, response_len]`` 0/1 valid tokens."""

    rollout_logprobs: torch.Tensor | None = None
    """``[batch, response_len]`` log-probs reported by the rollout engine; used by TIS."""

    rollout_is_weights: torch.Tensor | None = None
    """``[batch, response_len]`` detached rollout-correction IS weights (token or sequence level,
    :mod:`rltrain.algo.rollout_correction`) multiplying each token's loss; exclusive with
    ``PolicyLossParams.tis_cap``."""


@dataclass(frozen=True)
class PolicyLossParams:
    """Clip ranges and corrections of the policy loss (verl's ``actor.*`` names)."""

    clip_ratio: float = 0.2
    """ε of PPO: the ratio is clipped to ``[1 - ε, 1 + ε]``."""

    clip_ratio_low: float | None = None
    """Lower ε; ``None``: ``clip_ratio``."""

    clip_ratio_high: float | None = None
    """Upper ε (DAPO's clip-higher); ``None``: ``clip_ratio``."""

    clip_ratio_c: float = 3.0
    """Dual-clip bound (> 1): for negative advantages the per-token loss is at most
    ``clip_ratio_c · |A|``."""

    tis_cap: float | None = None
    """Truncated importance sampling: with ``rollout_logprobs`` each token's loss is weighted by
    ``min(exp(old_logprobs - rollout_logprobs), tis_cap)``; ``None`` disables it."""

    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of the micro-batch's valid tokens (at least one) that are cut."""

    clip_cov_lb: float = 1.0
    """clip_cov: candidates have a covariance in ``(clip_cov_lb, clip_cov_ub)``."""

    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of the candidates' covariance."""

    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of the micro-batch's valid tokens (at least one) that get the KL penalty."""

    ppo_kl_coef: float = 0.1
    """kl_cov: weight of ``|logprobs - old_logprobs|`` on the selected tokens."""

    tau_pos: float = 1.0
    """sapo: temperature of the gate on tokens with ``A > 0``."""

    tau_neg: float = 1.05
    """sapo: temperature of the gate on tokens with ``A <= 0``."""

    dro_beta: float | None = None
    """dro: weight of the quadratic log-ratio penalty; must be set (> 0) for dro."""

    def __post_init__(self) -> None:
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {self.clip_ratio_c}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if self.clip_cov_ratio <= 0 or self.kl_cov_ratio <= 0:
            raise ValueError(
                f"clip_cov_ratio and kl_cov_ratio must be > 0, got {self.clip_cov_ratio}, {self.kl_cov_ratio}"
            )
        if self.tau_pos <= 0 or self.tau_neg <= 0:
            raise ValueError(f"tau_pos and tau_neg must be > 0, got {self.tau_pos}, {self.tau_neg}")
        if self.dro_beta is not None and self.dro_beta <= 0:
            raise ValueError(f"dro_beta must be > 0, got {self.dro_beta}")

    @property
    def low(self) -> float:
        """Effective lower clip ε."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        """Effective upper clip ε."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


@dataclass
class PolicyLossOutput:
    """The aggregated policy loss and its metrics (metrics detached, 0-dim)."""

    loss: torch.Tensor
    """0-dim, differentiable w.r.t. ``logprobs``."""

    clipfrac: torch.Tensor
    """Fraction of valid tokens where the clipped surrogate was active (verl ``pg_clipfrac``; each
    loss of :mod:`rltrain.algo.policy_losses` and :mod:`rltrain.algo.trust_region_losses` says what
    it counts)."""

    clipfrac_lower: torch.Tensor
    """Fraction of valid tokens where the dual clip was active (negative advantage, verl
    ``pg_clipfrac_lower``); 0 for losses without a lower-side event."""

    ppo_kl: torch.Tensor
    """Mean of ``old_logprobs - logprobs`` over valid tokens (vanilla, cispo: clamped log-ratio)."""

    tis_weight_mean: torch.Tensor | None = None
    """Mean TIS (or rollout-correction IS) weight over valid tokens; ``None`` when no weight is applied."""


PolicyLossFn = Callable[[PolicyLossInputs, PolicyLossParams, LossAgg], PolicyLossOutput]

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


def compute_policy_loss(
    name: str, inputs: PolicyLossInputs, *, params: PolicyLossParams, agg: LossAgg
) -> PolicyLossOutput:
    """Run the policy loss registered as ``name`` (e.g. ``"vanilla"``) on one micro-batch.

    Args:
        name: a name in ``POLICY_LOSSES``.
        inputs: log-probs, advantages and mask, each ``[batch, response_len]``.
        params: clip ranges, dual clip and TIS cap.
        agg: aggregation mode and global denominators.

    Returns:
        The scalar loss and its metrics.
    """
    return POLICY_LOSSES.get(name)(inputs, params, agg)


def tis_weight(inputs: PolicyLossInputs, params: PolicyLossParams) -> torch.Tensor | None:
    """Detached ``[batch, response_len]`` TIS weights, or ``None`` when TIS is off.

    TIS is on when ``params.tis_cap`` is set; it then needs ``inputs.rollout_logprobs``.
    """
    if params.tis_cap is None:
        return None
    if inputs.rollout_logprobs is None:
        raise ValueError("tis_cap is set but PolicyLossInputs.rollout_logprobs is None")
    ratio_log = rollout_correction.log_ratio(inputs.old_logprobs, inputs.rollout_logprobs)
    return rollout_correction.is_weights(
        ratio_log, inputs.response_mask, level="token", threshold=params.tis_cap
    )


def loss_weight(inputs: PolicyLossInputs, params: PolicyLossParams) -> torch.Tensor | None:
    """The per-token weight of the loss: TIS (``params.tis_cap``) or ``inputs.rollout_is_weights``."""
    weight = tis_weight(inputs, params)
    if inputs.rollout_is_weights is None:
        return weight
    if weight is not None:
        raise ValueError("PolicyLossParams.tis_cap and PolicyLossInputs.rollout_is_weights are both set")
    return inputs.rollout_is_weights.detach()


@POLICY_LOSSES.register("vanilla")
def vanilla_policy_loss(inputs: PolicyLossInputs, params: PolicyLossParams, agg: LossAgg) -> PolicyLossOutput:
    """PPO clipped surrogate with dual clip and optional TIS / rollout-correction IS weights.

    Per token, with ``r = exp(logprobs - old_logprobs)``:
    ``max(-A r, -A clip(r, 1 - low, 1 + high))``, and for ``A < 0`` additionally capped at
    ``-A · clip_ratio_c``; multiplied by the TIS or rollout-correction weight when on, then
    aggregated by ``agg``.

    Shapes: all inputs ``[batch, response_len]`` -> 0-dim loss and metrics.
    """
    advantages, mask = inputs.advantages, inputs.response_mask
    log_ratio = (inputs.logprobs - inputs.old_logprobs).clamp(
        min=-rollout_correction.MAX_LOG_RATIO, max=rollout_correction.MAX_LOG_RATIO
    )
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - params.low, 1.0 + params.high)
    surrogate = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * params.clip_ratio_c
    negative = advantages < 0
    per_token = torch.where(negative, torch.minimum(surrogate, dual_bound), surrogate)

    weight = loss_weight(inputs, params)
    if weight is not None:
        per_token = per_token * weight

    with torch.no_grad():
        clipfrac = agg.token_mean((clipped > unclipped).to(ratio.dtype), mask)
        clipfrac_lower = agg.token_mean(((surrogate > dual_bound) & negative).to(ratio.dtype), mask)
        ppo_kl = agg.token_mean(-log_ratio, mask)
        tis_weight_mean = None if weight is None else agg.token_mean(weight, mask)
    return PolicyLossOutput(
        loss=agg(per_token, mask),
        clipfrac=clipfrac,
        clipfrac_lower=clipfrac_lower,
        ppo_kl=ppo_kl,
        tis_weight_mean=tis_weight_mean,
    )


@dataclass
class ValueLossOutput:
    """The aggregated value loss and its clip fraction."""

    loss: torch.Tensor
    """0-dim, differentiable w.r.t. ``vpreds``."""

    vf_clipfrac: torch.Tensor
    """Detached fraction of valid tokens where the clipped error was the larger one."""


def compute_value_loss(
    *,
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    agg: LossAgg,
) -> ValueLossOutput:
    """Clipped value loss: ``0.5 · agg(max((v - R)^2, (clip(v, V_old ± c) - R)^2))``.

    Args:
        vpreds: ``[batch, response_len]`` current critic predictions (carry the gradient).
        values: ``[batch, response_len]`` critic values at rollout time (the clip centre).
        returns: ``[batch, response_len]`` value targets.
        response_mask: ``[batch, response_len]`` 0/1 valid tokens.
        cliprange_value: ``c``, verl's ``critic.cliprange_value``.
        agg: aggregation mode and global denominators.

    Returns:
        The scalar loss and ``vf_clipfrac``.
    """
    vpreds_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpreds_clipped - returns) ** 2
    loss = 0.5 * agg(torch.maximum(unclipped, clipped), response_mask)
    with torch.no_grad():
        vf_clipfrac = agg.token_mean((clipped > unclipped).to(vpreds.dtype), response_mask)
    return ValueLossOutput(loss=loss, vf_clipfrac=vf_clipfrac)


def compute_entropy_loss(entropy: torch.Tensor, response_mask: torch.Tensor, agg: LossAgg) -> torch.Tensor:
    """Aggregated entropy ``[batch, response_len]`` -> 0-dim (the caller applies ``-entropy_coeff``)."""
    return agg(entropy, response_mask)


def compute_kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kind: str,
    agg: LossAgg,
) -> torch.Tensor:
    """KL loss for ``use_kl_loss``: ``agg(kl_penalty(logprobs, ref_logprobs, kind))``.

    Args:
        logprobs: ``[batch, response_len]`` current policy (carries the gradient).
        ref_logprobs: ``[batch, response_len]`` reference policy.
        response_mask: ``[batch, response_len]`` 0/1 valid tokens.
        kind: KL estimator name (verl's ``kl_loss_type``, usually ``low_var_kl``).
        agg: aggregation mode and global denominators.

    Returns:
        0-dim tensor; the caller multiplies by ``kl_loss_coef``.
    """
    return agg(kl_penalty(logprobs, ref_logprobs, kind), response_mask)
