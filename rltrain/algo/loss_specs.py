"""The actor's and critic's losses of a run, as data: what the run's algorithm
(:mod:`rltrain.trainer.algorithms`) decides and the ranks build each mini-batch's loss callable from
(:mod:`rltrain.workers.ppo_losses`, with the mini-batch's global denominators). Plain frozen values:
they travel to the ranks with each update.
"""

from __future__ import annotations

from dataclasses import dataclass

from rltrain.algo.losses import PolicyLossParams
from rltrain.algo.rollout_correction import RolloutCorrectionSpec


@dataclass(frozen=True)
class KLLoss:
    """The KL penalty as a loss term (verl's ``actor.use_kl_loss``)."""

    coef: float
    """``actor.kl_loss_coef``."""
    kind: str
    """``actor.kl_loss_type``: the KL estimator."""


@dataclass(frozen=True)
class ActorLoss:
    """The policy loss ``loss_mode`` with rollout correction, minus the entropy bonus, plus the KL loss."""

    loss_mode: str
    """A registered policy loss (``actor.policy_loss.loss_mode``)."""
    params: PolicyLossParams
    """Its clip ranges and coefficients."""
    loss_agg_mode: str
    """How token losses aggregate (``actor.loss_agg_mode``)."""
    loss_scale_factor: int | None
    """The constant of ``seq-mean-token-sum-norm``; None: the padded response width."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus (0: none)."""
    kl_loss: KLLoss | None = None
    """The KL loss against the reference, or None."""
    correction: RolloutCorrectionSpec | None = None
    """Rollout correction (importance weights, rejection), or None."""
    log_correction_metrics: bool = False
    """Whether to log the ``rollout_corr/*`` diagnostics."""
    mtp_loss_scaling_factor: float | None = None
    """Weight of the multi-token-prediction loss (``model.mtp.mtp_loss_scaling_factor`` with
    ``model.mtp.enable_train``); None: the MTP layers are ignored."""

    @property
    def inputs(self) -> tuple[str, ...]:
        """The step batch's fields the loss reads besides the masks."""
        names = ("old_logprobs", "advantages")
        if self.kl_loss is not None:
            names += ("ref_logprobs",)
        if self.correction is not None:
            names += ("rollout_logprobs",)
        return names


@dataclass(frozen=True)
class CriticLoss:
    """The clipped value loss around the values the critic predicted before the update."""

    loss_agg_mode: str
    """``critic.loss_agg_mode``."""
    loss_scale_factor: int | None
    """The constant of ``seq-mean-token-sum-norm`` (the critic's, else the actor's); None: the padded
    response width."""
    cliprange_value: float
    """``critic.cliprange_value``."""

    inputs: tuple[str, ...] = ("values", "returns")
    """The step batch's fields the loss reads besides the masks."""
