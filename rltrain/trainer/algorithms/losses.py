"""The losses of a run from its config, as the algorithm owns them (:class:`~rltrain.algo.loss_specs.ActorLoss`,
:class:`~rltrain.algo.loss_specs.CriticLoss`); the ranks build each mini-batch's loss callable from
them (:mod:`rltrain.workers.ppo_losses`).

Rollout correction (:func:`actor_correction`: ``algorithm.rollout_correction``, or its older spelling
``actor.tis_imp_ratio_cap``) weights the actor's per-token losses and, with rejection, drops the
rejected tokens from every actor term (policy, entropy, KL loss), as verl's modified
``response_mask`` does; the ranks then count the denominators over the kept tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from rltrain.algo import PolicyLossParams
from rltrain.algo.loss_specs import ActorLoss, CriticLoss, KLLoss
from rltrain.algo.rollout_correction import RolloutCorrectionSpec

if TYPE_CHECKING:
    from rltrain.config import ActorConfig, CriticConfig
    from rltrain.config.algorithm import AlgorithmConfig
    from rltrain.config.mtp import MTPConfig


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


def actor_loss_of(
    actor: ActorConfig, algorithm: AlgorithmConfig, *, mtp: MTPConfig | None = None
) -> ActorLoss:
    """The actor's loss: ``actor.policy_loss`` with its clip ranges, ``actor.entropy_coeff``, the KL
    loss with ``actor.use_kl_loss``, the rollout correction, and the MTP loss with
    ``model.mtp.enable_train`` (``mtp``)."""
    section = actor.policy_loss
    params = PolicyLossParams(
        clip_ratio=actor.clip_ratio,
        clip_ratio_low=actor.clip_ratio_low,
        clip_ratio_high=actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c,
        clip_cov_ratio=section.clip_cov_ratio,
        clip_cov_lb=section.clip_cov_lb,
        clip_cov_ub=section.clip_cov_ub,
        kl_cov_ratio=section.kl_cov_ratio,
        ppo_kl_coef=section.ppo_kl_coef,
        tau_pos=actor.tau_pos,
        tau_neg=actor.tau_neg,
        dro_beta=section.dro_beta,
    )
    correction = actor_correction(actor, algorithm)
    return ActorLoss(
        loss_mode=section.loss_mode,
        params=params,
        loss_agg_mode=actor.loss_agg_mode,
        loss_scale_factor=actor.loss_scale_factor,
        entropy_coeff=actor.entropy_coeff,
        kl_loss=KLLoss(actor.kl_loss_coef, actor.kl_loss_type) if actor.use_kl_loss else None,
        correction=None if correction is None else correction.spec,
        log_correction_metrics=correction is not None and correction.log_metrics,
        mtp_loss_scaling_factor=mtp.mtp_loss_scaling_factor if mtp is not None and mtp.enable_train else None,
    )


def critic_loss_of(critic: CriticConfig, actor: ActorConfig) -> CriticLoss:
    """The critic's clipped value loss; ``critic.loss_scale_factor`` null takes the actor's, as verl's YAML."""
    scale = actor.loss_scale_factor if critic.loss_scale_factor is None else critic.loss_scale_factor
    return CriticLoss(
        loss_agg_mode=critic.loss_agg_mode, loss_scale_factor=scale, cliprange_value=critic.cliprange_value
    )
