"""Loss callables of the actor and critic updates, assembled from :mod:`rltrain.algo`.

Each is a :class:`~rltrain.algo.token_batch.LossFn`: it sees one micro-batch's model outputs
(``logprobs``/``entropy`` or ``values``, ``[batch, response_len]``) and the micro-batch
(:class:`~rltrain.algo.token_batch.TokenBatch`), whose named loss inputs it reads: the actor
``old_logprobs``, ``advantages`` (+ ``ref_logprobs`` with the KL loss, ``rollout_logprobs`` with
rollout correction), the critic ``values`` and ``returns``. Every term is aggregated with the
mini-batch's global denominators, so the sum over micro-batches and data-parallel ranks is the
mini-batch loss (not for the policy losses clip_cov and kl_cov, which pick tokens by statistics of
the micro-batch: rltrain/algo/policy_losses.py); the metrics use the same denominators and add up
the same way.

Rollout correction (:func:`actor_correction`: ``algorithm.rollout_correction``, or its older
spelling ``actor.tis_imp_ratio_cap``) weights the actor's per-token losses and, with rejection,
drops the rejected tokens from every actor term (policy, entropy, KL loss), as verl's modified
``response_mask`` does; the caller then counts the denominators over the kept tokens
(:meth:`GlobalCounts.kept`). Advantages and the critic see every token (verl masks them too).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rltrain.algo import (
    PolicyLossInputs,
    PolicyLossParams,
    compute_entropy_loss,
    compute_kl_loss,
    compute_policy_loss,
    compute_value_loss,
)
from rltrain.algo.loss_agg import GlobalCounts
from rltrain.algo.rollout_correction import RolloutCorrectionSpec, apply_correction
from rltrain.algo.token_batch import LossFn, ModelOutput, TokenBatch
from rltrain.config import ActorConfig, CriticConfig
from rltrain.config.algorithm import AlgorithmConfig
from rltrain.logging import metrics as mk


@dataclass(frozen=True)
class ActorCorrection:
    """The actor's rollout correction, resolved from the config."""

    spec: RolloutCorrectionSpec
    """IS level and threshold, rejection bounds."""

    log_metrics: bool
    """Whether to log the ``rollout_corr/*`` diagnostics (the ``algorithm.rollout_correction``
    section is set; ``actor.tis_imp_ratio_cap`` alone keeps today's metrics)."""


def actor_correction(actor: ActorConfig, algorithm: AlgorithmConfig) -> ActorCorrection | None:
    """``algorithm.rollout_correction``, with ``actor.tis_imp_ratio_cap = C`` read as
    ``rollout_is=token, rollout_is_threshold=C`` (the config check refuses the two when they
    disagree); ``None`` when neither is set."""
    section, cap = algorithm.rollout_correction, actor.tis_imp_ratio_cap
    if section is None:
        if cap is None:
            return None
        return ActorCorrection(
            RolloutCorrectionSpec(rollout_is="token", rollout_is_threshold=cap), log_metrics=False
        )
    spec = section.spec()
    if spec.rollout_is is None and cap is not None:
        spec = replace(spec, rollout_is="token", rollout_is_threshold=cap)
    return ActorCorrection(spec, log_metrics=True)


def actor_loss_fn(
    cfg: ActorConfig, counts: GlobalCounts, *, correction: RolloutCorrectionSpec | None = None
) -> LossFn:
    """The policy loss ``actor.policy_loss.loss_mode`` (vanilla: PPO clipped surrogate + dual clip)
    with rollout correction, minus the entropy bonus, plus the KL loss. With a rejecting
    ``correction``, ``counts`` must be the kept ones (``GlobalCounts.kept``)."""
    agg = counts.agg(cfg.loss_agg_mode, loss_scale_factor=cfg.loss_scale_factor)
    section = cfg.policy_loss
    params = PolicyLossParams(
        clip_ratio=cfg.clip_ratio,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c,
        clip_cov_ratio=section.clip_cov_ratio,
        clip_cov_lb=section.clip_cov_lb,
        clip_cov_ub=section.clip_cov_ub,
        kl_cov_ratio=section.kl_cov_ratio,
        ppo_kl_coef=section.ppo_kl_coef,
        tau_pos=cfg.tau_pos,
        tau_neg=cfg.tau_neg,
        dro_beta=section.dro_beta,
    )
    # Metrics are token means over the mini-batch whatever the loss aggregation mode.
    token_mean = counts.agg("token-mean")

    def loss_fn(output: ModelOutput, micro_batch: TokenBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = micro_batch.response_mask.to(output.logprobs.dtype)
        weights = None
        if correction is not None:
            if micro_batch.rollout_logprobs is None:
                raise ValueError("rollout correction is on but the micro-batch carries no rollout_logprobs")
            corrected = apply_correction(
                micro_batch.old_logprobs, micro_batch.rollout_logprobs, mask, correction
            )
            mask, weights = corrected.mask, corrected.weights
        inputs = PolicyLossInputs(
            old_logprobs=micro_batch.old_logprobs,
            logprobs=output.logprobs,
            advantages=micro_batch.advantages,
            response_mask=mask,
            rollout_logprobs=micro_batch.rollout_logprobs,
            rollout_is_weights=weights,
        )
        policy = compute_policy_loss(section.loss_mode, inputs, params=params, agg=agg)
        loss = policy.loss
        metrics = {
            mk.ACTOR_PG_LOSS: policy.loss.detach(),
            mk.ACTOR_PG_CLIPFRAC: policy.clipfrac,
            mk.ACTOR_PG_CLIPFRAC_LOWER: policy.clipfrac_lower,
            mk.ACTOR_PPO_KL: policy.ppo_kl,
            mk.ACTOR_ENTROPY: compute_entropy_loss(output.entropy.detach(), mask, token_mean),
        }
        if policy.tis_weight_mean is not None:
            metrics[mk.ACTOR_TIS_WEIGHT_MEAN] = policy.tis_weight_mean
        if cfg.entropy_coeff:
            loss = loss - cfg.entropy_coeff * compute_entropy_loss(output.entropy, mask, agg)
        if cfg.use_kl_loss:
            kl = compute_kl_loss(
                output.logprobs, micro_batch.ref_logprobs, mask, kind=cfg.kl_loss_type, agg=agg
            )
            loss = loss + cfg.kl_loss_coef * kl
            metrics[mk.ACTOR_KL_LOSS] = kl.detach()
        return loss, metrics

    return loss_fn


def critic_loss_fn(
    cfg: CriticConfig, counts: GlobalCounts, *, actor_loss_scale_factor: int | None = None
) -> LossFn:
    """Clipped value loss around the values the critic predicted before the update.
    ``critic.loss_scale_factor`` null takes the actor's (``actor_loss_scale_factor``), as verl's YAML."""
    scale = actor_loss_scale_factor if cfg.loss_scale_factor is None else cfg.loss_scale_factor
    agg = counts.agg(cfg.loss_agg_mode, loss_scale_factor=scale)
    token_mean = counts.agg("token-mean")

    def loss_fn(output: ModelOutput, micro_batch: TokenBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = micro_batch.response_mask.to(output.values.dtype)
        result = compute_value_loss(
            vpreds=output.values,
            values=micro_batch.values,
            returns=micro_batch.returns,
            response_mask=mask,
            cliprange_value=cfg.cliprange_value,
            agg=agg,
        )
        metrics = {
            mk.CRITIC_VF_LOSS: result.loss.detach(),
            mk.CRITIC_VF_CLIPFRAC: result.vf_clipfrac,
            mk.CRITIC_VPRED_MEAN: token_mean(output.values.detach(), mask),
        }
        return result.loss, metrics

    return loss_fn
