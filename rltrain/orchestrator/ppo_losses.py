"""Loss callables of the actor and critic updates, assembled from :mod:`rltrain.algo`.

Each is a :class:`~rltrain.algo.token_batch.LossFn`: it sees one micro-batch's model outputs
(``logprobs``/``entropy`` or ``values``, ``[batch, response_len]``) and the micro-batch
(:class:`~rltrain.algo.token_batch.TokenBatch`), whose named loss inputs it reads: the actor
``old_logprobs``, ``advantages`` (+ ``ref_logprobs`` with the KL loss, ``rollout_logprobs`` with
TIS), the critic ``values`` and ``returns``. Every term is aggregated with the
mini-batch's global denominators, so the sum over micro-batches and data-parallel ranks is the
mini-batch loss; the metrics use the same denominators and add up the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltrain.algo import (
    LossAgg,
    PolicyLossInputs,
    PolicyLossParams,
    compute_entropy_loss,
    compute_kl_loss,
    compute_policy_loss,
    compute_value_loss,
)
from rltrain.algo.token_batch import LossFn, ModelOutput, TokenBatch
from rltrain.config import ActorConfig, CriticConfig
from rltrain.logging import metrics as mk


@dataclass(frozen=True)
class GlobalCounts:
    """Denominators of one mini-batch, counted over all of its samples (all ranks)."""

    num_tokens: int
    """Valid response tokens."""

    num_seqs: int
    """Samples with at least one valid response token."""

    response_length: int
    """Padded response width (the constant of ``seq-mean-token-sum-norm``)."""

    @classmethod
    def of(cls, response_mask: torch.Tensor) -> GlobalCounts:
        return cls(
            num_tokens=int(response_mask.sum()),
            num_seqs=int((response_mask.sum(-1) > 0).sum()),
            response_length=response_mask.size(-1),
        )

    def agg(self, mode: str) -> LossAgg:
        return LossAgg(
            mode,
            global_num_tokens=self.num_tokens,
            global_num_seqs=self.num_seqs,
            loss_scale_factor=self.response_length,
        )


def actor_loss_fn(cfg: ActorConfig, counts: GlobalCounts) -> LossFn:
    """PPO clipped surrogate (+ dual clip, TIS), minus the entropy bonus, plus the KL loss."""
    agg = counts.agg(cfg.loss_agg_mode)
    params = PolicyLossParams(
        clip_ratio=cfg.clip_ratio,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c,
        tis_cap=cfg.tis_imp_ratio_cap,
    )
    # Metrics are token means over the mini-batch whatever the loss aggregation mode.
    token_mean = counts.agg("token-mean")

    def loss_fn(output: ModelOutput, micro_batch: TokenBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = micro_batch.response_mask.to(output.logprobs.dtype)
        inputs = PolicyLossInputs(
            old_logprobs=micro_batch.old_logprobs,
            logprobs=output.logprobs,
            advantages=micro_batch.advantages,
            response_mask=mask,
            rollout_logprobs=micro_batch.rollout_logprobs,
        )
        policy = compute_policy_loss(cfg.policy_loss, inputs, params=params, agg=agg)
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


def critic_loss_fn(cfg: CriticConfig, counts: GlobalCounts) -> LossFn:
    """Clipped value loss around the values the critic predicted before the update."""
    agg = counts.agg(cfg.loss_agg_mode)
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
