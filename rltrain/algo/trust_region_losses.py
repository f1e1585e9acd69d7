"""Policy losses that bound the update without PPO's ratio clip, registered under verl's names.

sapo replaces the clip by a soft gate, dro by a quadratic penalty, dppo_tv and dppo_kl by a mask
of the tokens whose probability moved too far. Contract and notation are those of
:mod:`rltrain.algo.policy_losses` (``m``, ``lr = logp - old_logp``, ``r``, ``A``, ``sg``,
``low``/``high``, ``N_seq``); further ``p = exp(logp)``, ``p_old = exp(old_logp)``, ``σ`` the
logistic sigmoid. TIS / rollout-correction weights multiply each token's loss. The formulas are
verl 0.9.1's (``verl/trainer/ppo/core_algos.py``: ``compute_policy_loss_sapo``, ``_dro``,
``_dppo_tv``, ``_dppo_kl``), unchanged on verl's main branch at commit 1dda039b (0.10.0.dev).

Split invariance holds for all four: a token's term depends on that token alone, and sapo's
seq-mean-token-mean takes each row's token mean within the row.

sapo: Soft Adaptive Policy Optimization (Qwen team 2025, arXiv 2511.20347)
    ``r = exp(clamp(lr, ±20))``, ``τ = tau_pos`` where ``A > 0`` else ``tau_neg``
    (``actor.tau_pos``, ``actor.tau_neg``), the gate ``f(r) = σ(τ (r - 1)) · 4/τ``,
    ``L_t = -f(r) A``. ``∂f/∂logp = 4 σ (1 - σ) r``: at ``r = 1`` the gradient is the policy
    gradient's ``-A``, and it fades smoothly as ``r`` leaves 1 where PPO's clip cuts it (faster
    for the larger ``τ``). Aggregated by seq-mean-token-mean whatever ``loss_agg_mode`` says, as
    verl hard-codes it. No clip: clipfrac and clipfrac_lower 0.

dro: Direct Reward Optimization (verl PR #7245, verl's ``docs/algo/dro.md``)
    ``L_t = -(A logp - β/2 · lr²)`` with ``β = policy_loss.dro_beta`` (no default: dro refuses to
    run without a positive one, as verl does). The gradient ``-A + β lr`` is the policy gradient
    pulled back towards ``old_logp``. ``lr`` is not clamped (verl's). Aggregated by
    ``loss_agg_mode``. verl logs only ``ppo_kl``; clipfrac and clipfrac_lower are 0 here.

dppo_tv, dppo_kl: Divergence PPO, Binary-TV and Binary-KL (Qi et al. 2026, arXiv 2602.04879)
    ``L_t = -A · sg(min(r, clip_ratio_c)) · logp · keep``: the policy gradient weighted by the
    truncated, detached ratio (TIS instead of the dual clip), on the tokens ``keep`` inside the
    trust region. The bounds are ``actor.clip_ratio_low/high`` read as divergences, not ratio ε's
    (verl's example: 0.15 for TV, 0.05 for KL, ``clip_ratio_c: 10000``); the cap is
    ``actor.clip_ratio_c`` (verl's code falls back to 20 only when the key is absent, which its
    config never lets happen, so its default is 3.0 as here). ``r`` uses ``lr`` clamped to ±20.
    A token is kept when, for ``A > 0`` (``A <= 0``), its probability did not move too far up
    (down):

    - TV: ``p - p_old <= high`` (``p - p_old >= -low``).
    - KL: ``D <= high or p <= p_old`` (``D <= low or p >= p_old``) with the binary KL
      ``D = p_old (old_logp - logp) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))``.

    A dropped token has neither loss nor gradient. Aggregated by ``loss_agg_mode``. clipfrac: the
    valid tokens dropped; clipfrac_lower: the kept tokens whose ratio exceeds ``clip_ratio_c``
    (verl's).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from rltrain.algo.loss_agg import LossAgg
from rltrain.algo.losses import (
    POLICY_LOSSES,
    PolicyLossInputs,
    PolicyLossOutput,
    PolicyLossParams,
    loss_weight,
)
from rltrain.algo.policy_losses import loss_output, weighted
from rltrain.algo.rollout_correction import MAX_LOG_RATIO

BINARY_KL_EPS = 1e-8
"""Added to ``1 - p`` and ``1 - p_old`` inside dppo_kl's logarithm (verl's)."""


def _clamped_log_ratio(inputs: PolicyLossInputs) -> torch.Tensor:
    """``[batch, response_len]`` ``logp - old_logp`` clamped to ±``MAX_LOG_RATIO``."""
    return (inputs.logprobs - inputs.old_logprobs).clamp(min=-MAX_LOG_RATIO, max=MAX_LOG_RATIO)


@POLICY_LOSSES.register("sapo")
def sapo_policy_loss(inputs: PolicyLossInputs, params: PolicyLossParams, agg: LossAgg) -> PolicyLossOutput:
    """SAPO: ``-A`` times a sigmoid gate of the token ratio; always seq-mean-token-mean.

    All inputs ``[batch, response_len]``; 0-dim loss and metrics."""
    advantages = inputs.advantages
    log_ratio = _clamped_log_ratio(inputs)
    tau = torch.where(
        advantages > 0,
        torch.as_tensor(params.tau_pos, dtype=advantages.dtype, device=advantages.device),
        torch.as_tensor(params.tau_neg, dtype=advantages.dtype, device=advantages.device),
    )
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    weight = loss_weight(inputs, params)
    per_token = weighted(-gate * advantages, weight)
    loss = replace(agg, mode="seq-mean-token-mean")(per_token, inputs.response_mask)
    return loss_output(loss, inputs, agg, log_ratio=log_ratio, weight=weight)


@POLICY_LOSSES.register("dro")
def dro_policy_loss(inputs: PolicyLossInputs, params: PolicyLossParams, agg: LossAgg) -> PolicyLossOutput:
    """DRO: the policy gradient loss plus ``dro_beta / 2`` times the squared log-ratio.

    All inputs ``[batch, response_len]``; 0-dim loss and metrics."""
    if params.dro_beta is None:
        raise ValueError("policy loss 'dro' needs actor.policy_loss.dro_beta > 0; it is null")
    log_ratio = inputs.logprobs - inputs.old_logprobs
    per_token = -(inputs.advantages * inputs.logprobs - 0.5 * params.dro_beta * log_ratio.square())
    weight = loss_weight(inputs, params)
    loss = agg(weighted(per_token, weight), inputs.response_mask)
    return loss_output(loss, inputs, agg, log_ratio=log_ratio, weight=weight)


def _divergence_policy_gradient(
    inputs: PolicyLossInputs, params: PolicyLossParams, agg: LossAgg, keep: torch.Tensor
) -> PolicyLossOutput:
    """DPPO's loss on the kept tokens (boolean ``keep`` ``[batch, response_len]``), shared by both
    divergences: ``-A · sg(min(r, clip_ratio_c)) · logp``; 0-dim loss and metrics."""
    log_ratio = _clamped_log_ratio(inputs)
    ratio = torch.exp(log_ratio).detach()
    truncated = ratio.clamp(max=params.clip_ratio_c)
    kept = keep.to(ratio.dtype)
    per_token = -inputs.advantages * truncated * inputs.logprobs * kept
    weight = loss_weight(inputs, params)
    loss = agg(weighted(per_token, weight), inputs.response_mask)
    return loss_output(
        loss,
        inputs,
        agg,
        log_ratio=log_ratio,
        weight=weight,
        clipped=~keep,
        clipped_lower=keep & (ratio > params.clip_ratio_c),
    )


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv_policy_loss(inputs: PolicyLossInputs, params: PolicyLossParams, agg: LossAgg) -> PolicyLossOutput:
    """DPPO-Binary-TV: truncated-IS policy gradient on tokens whose probability moved at most
    ``high`` up (``A > 0``) or ``low`` down (``A <= 0``).

    All inputs ``[batch, response_len]``; 0-dim loss and metrics."""
    with torch.no_grad():
        moved = torch.exp(inputs.logprobs) - torch.exp(inputs.old_logprobs)
        keep = torch.where(inputs.advantages > 0, moved <= params.high, moved >= -params.low)
    return _divergence_policy_gradient(inputs, params, agg, keep)


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl_policy_loss(inputs: PolicyLossInputs, params: PolicyLossParams, agg: LossAgg) -> PolicyLossOutput:
    """DPPO-Binary-KL: truncated-IS policy gradient on tokens whose binary KL to the old policy is
    within ``high`` (probability up, ``A > 0``) or ``low`` (probability down, ``A <= 0``).

    All inputs ``[batch, response_len]``; 0-dim loss and metrics."""
    with torch.no_grad():
        logprobs, old_logprobs = inputs.logprobs, inputs.old_logprobs
        prob, old_prob = torch.exp(logprobs), torch.exp(old_logprobs)
        binary_kl = old_prob * (old_logprobs - logprobs) + (1.0 - old_prob) * torch.log(
            (1.0 - old_prob + BINARY_KL_EPS) / (1.0 - prob + BINARY_KL_EPS)
        )
        keep = torch.where(
            inputs.advantages > 0,
            (binary_kl <= params.high) | (prob <= old_prob),
            (binary_kl <= params.low) | (prob >= old_prob),
        )
    return _divergence_policy_gradient(inputs, params, agg, keep)
