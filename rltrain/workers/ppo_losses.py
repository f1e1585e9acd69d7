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

What each loss is comes from the run's algorithm as data (:class:`~rltrain.algo.loss_specs.ActorLoss`,
:class:`~rltrain.algo.loss_specs.CriticLoss`, built in :mod:`rltrain.trainer.algorithms.losses`).
Rollout correction weights the actor's per-token losses and, with rejection, drops the rejected
tokens from every actor term (policy, entropy, KL loss), as verl's modified ``response_mask`` does;
the caller then counts the denominators over the kept tokens (:meth:`GlobalCounts.kept`).
Advantages and the critic see every token (verl masks them too).
"""

from __future__ import annotations

import torch

from rltrain.algo import (
    PolicyLossInputs,
    compute_entropy_loss,
    compute_kl_loss,
    compute_policy_loss,
    compute_value_loss,
)
from rltrain.algo.loss_agg import GlobalCounts
from rltrain.algo.loss_specs import ActorLoss, CriticLoss
from rltrain.algo.mtp_loss import mtp_loss
from rltrain.algo.rollout_correction import apply_correction
from rltrain.algo.token_batch import LossFn, ModelOutput, TokenBatch
from rltrain.logging import metrics as mk


def actor_loss_fn(spec: ActorLoss, counts: GlobalCounts) -> LossFn:
    """``spec``'s policy loss (vanilla: PPO clipped surrogate + dual clip) with rollout correction,
    minus the entropy bonus, plus the KL loss and the MTP loss (:mod:`rltrain.algo.mtp_loss`). With a
    rejecting correction, ``counts`` must be the kept ones (``GlobalCounts.kept``)."""
    agg = counts.agg(spec.loss_agg_mode, loss_scale_factor=spec.loss_scale_factor)
    params, correction = spec.params, spec.correction
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
        policy = compute_policy_loss(spec.loss_mode, inputs, params=params, agg=agg)
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
        if spec.entropy_coeff:
            loss = loss - spec.entropy_coeff * compute_entropy_loss(output.entropy, mask, agg)
        if spec.kl_loss is not None:
            kl = compute_kl_loss(
                output.logprobs, micro_batch.ref_logprobs, mask, kind=spec.kl_loss.kind, agg=agg
            )
            loss = loss + spec.kl_loss.coef * kl
            metrics[mk.ACTOR_KL_LOSS] = kl.detach()
        if spec.mtp_loss_scaling_factor is not None:
            if output.mtp_logprobs is None:
                raise ValueError(
                    "the actor's loss trains the MTP layers, but the model returned no MTP log-probs"
                )
            mtp = mtp_loss(output.mtp_logprobs, micro_batch.attention_mask, mask, agg)
            loss = loss + spec.mtp_loss_scaling_factor * mtp
            metrics[mk.ACTOR_MTP_LOSS] = mtp.detach()
        return loss, metrics

    return loss_fn


def critic_loss_fn(spec: CriticLoss, counts: GlobalCounts) -> LossFn:
    """Clipped value loss around the values the critic predicted before the update."""
    agg = counts.agg(spec.loss_agg_mode, loss_scale_factor=spec.loss_scale_factor)
    token_mean = counts.agg("token-mean")

    def loss_fn(output: ModelOutput, micro_batch: TokenBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = micro_batch.response_mask.to(output.values.dtype)
        result = compute_value_loss(
            vpreds=output.values,
            values=micro_batch.values,
            returns=micro_batch.returns,
            response_mask=mask,
            cliprange_value=spec.cliprange_value,
            agg=agg,
        )
        metrics = {
            mk.CRITIC_VF_LOSS: result.loss.detach(),
            mk.CRITIC_VF_CLIPFRAC: result.vf_clipfrac,
            mk.CRITIC_VPRED_MEAN: token_mean(output.values.detach(), mask),
        }
        return result.loss, metrics

    return loss_fn
