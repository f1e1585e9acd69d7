"""Policy losses beyond PPO's clipped surrogate, registered in ``POLICY_LOSSES`` under verl's names.

Contract: like ``vanilla`` (:mod:`rltrain.algo.losses`) each loss takes one micro-batch's
:class:`PolicyLossInputs` (``[batch, response_len]``), the clip ranges and settings in
:class:`PolicyLossParams` and the aggregation :class:`LossAgg` carrying the mini-batch's global
denominators, and returns the 0-dim loss and detached 0-dim metrics. TIS / rollout-correction
weights multiply each token's loss (geo_mean: each sequence's). Notation: ``m`` the mask,
``lr = logp - old_logp``, ``r = exp(lr)``, ``A`` the advantage, ``sg`` stop-gradient, ``low`` and
``high`` the clip ε's (``actor.clip_ratio_low/high``, each ``clip_ratio`` when unset), ``N_seq``
the sequences with a valid token. ``ppo_kl`` is always the token mean of ``-lr``; ``clipfrac`` and
``clipfrac_lower`` count what each section says, 0 where a loss has no such event. sapo, dro,
dppo_tv and dppo_kl, which bound the update without PPO's clip, are in
:mod:`rltrain.algo.trust_region_losses`.

Split invariance (micro-batch losses with global denominators add up to the mini-batch loss)
holds for gspo, cispo, geo_mean, gpg and reinforce: a token's or sequence's term depends on its
own sequence only. It cannot hold for clip_cov and kl_cov: they choose tokens by statistics of the
micro-batch they are given (means, counts), as verl does with its micro-batches; the chosen
tokens' losses are then aggregated with the global denominators like any other.

gspo: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071)
    ``s_i = exp(Σ_t m lr / Σ_t m)``, the geometric mean of the sequence's token ratios. Per token
    ``s_it = sg(s_i) · π(y_t) / sg(π(y_t))`` has the value ``s_i`` and the gradient
    ``s_i ∇logp_t`` (log clamped at 10, as verl); ``L_it = max(-A s_it, -A clip(s_it, 1-low,
    1+high))``, aggregated by ``loss_agg_mode`` like any token loss, as verl 0.9.1 does (verl up
    to 0.9.0 forced seq-mean-token-mean). Departure from the paper: the paper's objective is
    seq-mean-token-mean (its ``1/|y_i|`` inside, mean over sequences outside); set
    ``loss_agg_mode: seq-mean-token-mean`` for it, the default ``token-mean`` weights sequences by
    their length. With a token-level ``A`` this is the paper's GSPO-token; with GRPO's
    sequence-level ``A`` it is GSPO. No dual clip. The paper clips very tightly
    (``clip_ratio_low=3e-4``, ``clip_ratio_high=4e-4``). clipfrac: tokens whose clipped term is
    the larger; clipfrac_lower 0.

cispo: Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585)
    ``L_t = -sg(clip(r, 1-low, 1+high)) · A · logp``: REINFORCE weighted by the clipped, detached
    ratio, so no token leaves the gradient (PPO's clip drops them). The log-ratio is clamped to
    ±20 before ``exp``. Departure from the paper, as in verl: the paper bounds the weight only
    from above; here both bounds apply, so set ``clip_ratio_low: 1.0`` (lower bound 0) for the
    paper's. clipfrac: tokens with ``r`` outside the range; clipfrac_lower 0.

geo_mean: Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv 2507.20673)
    Token log-ratios are clipped in log space, pessimistically for the sign of ``A``:
    ``ĉ_t = sgn(A) min(sgn(A) lr, sgn(A) clamp(lr, -low, high))``; ``ρ_i = exp(Σ_t m ĉ / Σ_t m)``,
    ``Ā_i = Σ_t m A / Σ_t m``, ``L_i = -Ā_i ρ_i``, loss ``Σ_i L_i / N_seq``; ``loss_agg_mode`` is
    ignored, as in verl. The bounds are log-space: the paper's ratio range ``(e^-0.4, e^0.4)`` is
    ``clip_ratio: 0.4``. IS weights enter per sequence as the geometric mean of the token weights
    (verl's). Departure from verl: verl takes ``torch.mean`` over the micro-batch's rows, counting
    rows without a valid token and using the local count; here those rows are not counted and
    ``N_seq`` is the mini-batch's, so micro-batches add up (the same value for one micro-batch
    without empty rows). clipfrac / clipfrac_lower: tokens with ``lr`` outside the range and
    ``A > 0`` / ``A < 0`` (verl's).

clip_cov: Clip-Cov (Cui et al. 2025, arXiv 2505.22617)
    ``cov_t = (A_t - mean A)(logp_t - mean logp)``, means over the micro-batch's valid tokens.
    Candidates: valid tokens not clipped by PPO's range whose ``cov`` lies in ``(clip_cov_lb,
    clip_cov_ub)``; ``max(⌊clip_cov_ratio · N⌋, 1)`` of them (``N`` the micro-batch's valid
    tokens), drawn uniformly with ``torch.randperm`` on the default generator (as verl; the run's
    seed makes it reproducible), are cut: their loss is 0, value and gradient. The others get
    ``max(-A r, -A clip(r, 1-low, 1+high))``, with no dual clip and no log-ratio clamp (verl's).
    clipfrac: the fraction of valid tokens cut (verl's ``pg_clipfrac`` here); clipfrac_lower 0.

kl_cov: KL-Cov (same paper)
    ``cov`` as in clip_cov; the ``max(⌊kl_cov_ratio · N⌋, 1)`` valid tokens of largest ``cov``
    get ``L_t = -A r + ppo_kl_coef |lr|``, all others ``L_t = -A r``: no clipping at all.
    clipfrac: the fraction of valid tokens penalized (verl logs none); clipfrac_lower 0. verl's
    kl_cov logs the mean ``|lr|`` as ``ppo_kl``; here ``ppo_kl`` keeps its one meaning.

gpg, reinforce: the plain policy gradient (GPG: Chu et al. 2025, arXiv 2504.02546; REINFORCE:
Williams 1992)
    ``L_t = -A logp``: no ratio, no clip (``old_logprobs`` only feed ``ppo_kl``). ``gpg`` is
    verl's name; verl's REINFORCE loss (``compute_policy_loss_reinforce``, reached through
    ``bypass_mode``) is the same formula without a registered name, so it is registered here as
    ``reinforce``: one function, two names. GPG's other half is its advantage estimator. clipfrac
    and clipfrac_lower 0.
"""

from __future__ import annotations

import torch

from rltrain.algo.loss_agg import LossAgg
from rltrain.algo.losses import (
    POLICY_LOSSES,
    PolicyLossInputs,
    PolicyLossOutput,
    PolicyLossParams,
    loss_weight,
)
from rltrain.algo.masked import masked_mean
from rltrain.algo.rollout_correction import MAX_LOG_RATIO

GSPO_MAX_LOG_RATIO = 10.0
"""Upper clamp of GSPO's per-token log sequence ratio before ``exp`` (verl's)."""


def _fraction(event: torch.Tensor, mask: torch.Tensor, agg: LossAgg, dtype: torch.dtype) -> torch.Tensor:
    """Detached token mean of the boolean ``event`` ``[batch, response_len]``."""
    return agg.token_mean(event.to(dtype), mask).detach()


def loss_output(
    loss: torch.Tensor,
    inputs: PolicyLossInputs,
    agg: LossAgg,
    *,
    log_ratio: torch.Tensor,
    weight: torch.Tensor | None,
    clipped: torch.Tensor | None = None,
    clipped_lower: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """The 0-dim ``loss`` with its metrics: ``clipped`` / ``clipped_lower`` are boolean
    ``[batch, response_len]`` events counted as clipfrac / clipfrac_lower (``None``: 0),
    ``log_ratio`` ``[batch, response_len]`` feeds ``ppo_kl``, ``weight`` the IS weight mean."""
    mask, dtype = inputs.response_mask, inputs.logprobs.dtype
    with torch.no_grad():
        zero = torch.zeros((), dtype=dtype, device=loss.device)
        return PolicyLossOutput(
            loss=loss,
            clipfrac=zero if clipped is None else _fraction(clipped, mask, agg, dtype),
            clipfrac_lower=zero if clipped_lower is None else _fraction(clipped_lower, mask, agg, dtype),
            ppo_kl=agg.token_mean(-log_ratio.detach(), mask),
            tis_weight_mean=None if weight is None else agg.token_mean(weight, mask),
        )


def weighted(per_token: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """``per_token`` ``[batch, response_len]`` times the IS ``weight`` of the same shape, if any."""
    return per_token if weight is None else per_token * weight


def _surrogates(
    ratio: torch.Tensor, advantages: torch.Tensor, params: PolicyLossParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's ``-A r`` and ``-A clip(r, 1 - low, 1 + high)``, ``[batch, response_len]`` each."""
    return -advantages * ratio, -advantages * ratio.clamp(1.0 - params.low, 1.0 + params.high)


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(inputs: PolicyLossInputs, params: PolicyLossParams, agg: LossAgg) -> PolicyLossOutput:
    """GSPO: the clipped surrogate of the sequence's geometric-mean ratio, per-token gradients.

    All inputs ``[batch, response_len]``; 0-dim loss and metrics."""
    advantages, mask, logprobs = inputs.advantages, inputs.response_mask, inputs.logprobs
    log_ratio = logprobs - inputs.old_logprobs
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1).detach().unsqueeze(-1)
    token_log_ratio = (logprobs - logprobs.detach() + seq_log_ratio).clamp(max=GSPO_MAX_LOG_RATIO)
    unclipped, clipped = _surrogates(torch.exp(token_log_ratio), advantages, params)
    weight = loss_weight(inputs, params)
    per_token = weighted(torch.maximum(unclipped, clipped), weight)
    loss = agg(per_token, mask)
    return loss_output(loss, inputs, agg, log_ratio=log_ratio, weight=weight, clipped=clipped > unclipped)


@POLICY_LOSSES.register("cispo")
def cispo_policy_loss(inputs: PolicyLossInputs, params: PolicyLossParams, agg: LossAgg) -> PolicyLossOutput:
    """CISPO: REINFORCE weighted by the detached, clipped importance ratio.

    All inputs ``[batch, response_len]``; 0-dim loss and metrics."""
    log_ratio = (inputs.logprobs - inputs.old_logprobs).clamp(min=-MAX_LOG_RATIO, max=MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - params.low, 1.0 + params.high)
    weight = loss_weight(inputs, params)
    per_token = weighted(-clipped_ratio.detach() * inputs.advantages * inputs.logprobs, weight)
    loss = agg(per_token, inputs.response_mask)
    return loss_output(loss, inputs, agg, log_ratio=log_ratio, weight=weight, clipped=ratio != clipped_ratio)


@POLICY_LOSSES.register("geo_mean")
def geo_mean_policy_loss(
    inputs: PolicyLossInputs, params: PolicyLossParams, agg: LossAgg
) -> PolicyLossOutput:
    """GMPO: the sequence's geometric-mean ratio (token log-ratios clipped) times its mean advantage.

    All inputs ``[batch, response_len]``; 0-dim loss and metrics."""
    log_ratio = inputs.logprobs - inputs.old_logprobs
    clamped = log_ratio.clamp(-params.low, params.high)
    advantages, mask = inputs.advantages, inputs.response_mask
    sign = torch.sign(advantages)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    seq_ratio = torch.exp(masked_mean(pessimistic, mask, dim=-1))
    seq_loss = -masked_mean(advantages, mask, dim=-1) * seq_ratio
    weight = loss_weight(inputs, params)
    if weight is not None:
        seq_loss = seq_loss * torch.exp(masked_mean(torch.log(weight + 1e-10), mask, dim=-1))
    outside = log_ratio != clamped
    return loss_output(
        agg.seq_mean(seq_loss, mask),
        inputs,
        agg,
        log_ratio=log_ratio,
        weight=weight,
        clipped=outside & (advantages > 0),
        clipped_lower=outside & (advantages < 0),
    )


def token_covariance(inputs: PolicyLossInputs) -> torch.Tensor:
    """Detached ``[batch, response_len]`` ``(A - mean A)(logp - mean logp)``, means over valid tokens."""
    mask = inputs.response_mask
    advantages, logprobs = inputs.advantages.detach(), inputs.logprobs.detach()
    return (advantages - masked_mean(advantages, mask)) * (logprobs - masked_mean(logprobs, mask))


def _at(positions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A boolean tensor shaped like ``like``, true at the flat ``positions``."""
    chosen = torch.zeros(like.shape, dtype=torch.bool, device=like.device)
    chosen.view(-1)[positions] = True
    return chosen


@POLICY_LOSSES.register("clip_cov")
def clip_cov_policy_loss(
    inputs: PolicyLossInputs, params: PolicyLossParams, agg: LossAgg
) -> PolicyLossOutput:
    """Clip-Cov: PPO's clipped surrogate with a random few high-covariance tokens cut from the loss.

    All inputs ``[batch, response_len]``; 0-dim loss and metrics."""
    advantages, mask = inputs.advantages, inputs.response_mask
    log_ratio = inputs.logprobs - inputs.old_logprobs
    unclipped, clipped = _surrogates(torch.exp(log_ratio), advantages, params)
    valid = mask.bool()
    with torch.no_grad():
        cov = token_covariance(inputs)
        candidate = valid & ~(clipped > unclipped) & (cov > params.clip_cov_lb) & (cov < params.clip_cov_ub)
        positions = candidate.reshape(-1).nonzero().flatten()
        num_cut = max(int(params.clip_cov_ratio * int(valid.sum())), 1)
        if positions.numel():
            positions = positions[torch.randperm(positions.numel())[:num_cut].to(positions.device)]
        cut = _at(positions, mask)
    weight = loss_weight(inputs, params)
    per_token = weighted(torch.maximum(unclipped, clipped) * (~cut).to(unclipped.dtype), weight)
    loss = agg(per_token, mask)
    return loss_output(loss, inputs, agg, log_ratio=log_ratio, weight=weight, clipped=cut)


@POLICY_LOSSES.register("kl_cov")
def kl_cov_policy_loss(inputs: PolicyLossInputs, params: PolicyLossParams, agg: LossAgg) -> PolicyLossOutput:
    """KL-Cov: the unclipped IS surrogate plus ``ppo_kl_coef · |lr|`` on the top-covariance tokens.

    All inputs ``[batch, response_len]``; 0-dim loss and metrics."""
    advantages, mask = inputs.advantages, inputs.response_mask
    log_ratio = inputs.logprobs - inputs.old_logprobs
    per_token = -advantages * torch.exp(log_ratio)
    with torch.no_grad():
        valid_positions = mask.bool().reshape(-1).nonzero().flatten()
        positions = valid_positions[:0]
        if valid_positions.numel():
            cov = token_covariance(inputs).reshape(-1)[valid_positions]
            num_penalized = max(int(valid_positions.numel() * params.kl_cov_ratio), 1)
            positions = valid_positions[torch.topk(cov, num_penalized).indices]
        penalized = _at(positions, mask)
    per_token = torch.where(penalized, per_token + params.ppo_kl_coef * log_ratio.abs(), per_token)
    weight = loss_weight(inputs, params)
    loss = agg(weighted(per_token, weight), mask)
    return loss_output(loss, inputs, agg, log_ratio=log_ratio, weight=weight, clipped=penalized)


@POLICY_LOSSES.register("gpg")
def policy_gradient_loss(
    inputs: PolicyLossInputs, params: PolicyLossParams, agg: LossAgg
) -> PolicyLossOutput:
    """The plain policy gradient ``-A logp`` (verl's ``gpg``; also registered as ``reinforce``).

    All inputs ``[batch, response_len]``; 0-dim loss and metrics."""
    weight = loss_weight(inputs, params)
    per_token = weighted(-inputs.advantages * inputs.logprobs, weight)
    loss = agg(per_token, inputs.response_mask)
    return loss_output(loss, inputs, agg, log_ratio=inputs.logprobs - inputs.old_logprobs, weight=weight)


POLICY_LOSSES.register("reinforce")(policy_gradient_loss)
