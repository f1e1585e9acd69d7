"""Loss callables of the actor and critic updates, assembled from :mod:`rltrain.algo`.

A callable sees one micro-batch: the model's outputs (``logprobs``/``entropy`` or ``values``,
``[batch, response_len]``) and the micro-batch, whose ``extras`` carry the step's tensors under the
:class:`~rltrain.orchestrator.batch.StepBatch` field names. Every term is aggregated with the
mini-batch's global denominators, so the sum over micro-batches and data-parallel ranks is the
mini-batch loss; the metrics use the same denominators and add up the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
from rltrain.config import ActorConfig, CriticConfig

LossFn = Callable[[Any, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]


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

    def loss_fn(output, micro_batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        extras = micro_batch.extras
        mask = micro_batch.response_mask.to(output.logprobs.dtype)
        inputs = PolicyLossInputs(
            old_logprobs=extras["old_logprobs"],
            logprobs=output.logprobs,
            advantages=extras["advantages"],
            response_mask=mask,
            rollout_logprobs=extras.get("rollout_logprobs"),
        )
        policy = compute_policy_loss(cfg.policy_loss, inputs, params=params, agg=agg)
        loss = policy.loss
        metrics = {
            "actor/pg_loss": policy.loss.detach(),
            "actor/pg_clipfrac": policy.clipfrac,
            "actor/pg_clipfrac_lower": policy.clipfrac_lower,
            "actor/ppo_kl": policy.ppo_kl,
            "actor/entropy": compute_entropy_loss(output.entropy.detach(), mask, token_mean),
        }
        if policy.tis_weight_mean is not None:
            metrics["actor/tis_weight_mean"] = policy.tis_weight_mean
        if cfg.entropy_coeff:
            loss = loss - cfg.entropy_coeff * compute_entropy_loss(output.entropy, mask, agg)
        if cfg.use_kl_loss:
            kl = compute_kl_loss(
                output.logprobs, extras["ref_logprobs"], mask, kind=cfg.kl_loss_type, agg=agg
            )
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.detach()
        return loss, metrics

    return loss_fn


def critic_loss_fn(cfg: CriticConfig, counts: GlobalCounts) -> LossFn:
    """Clipped value loss around the values the critic predicted before the update."""
    agg = counts.agg(cfg.loss_agg_mode)
    token_mean = counts.agg("token-mean")

    def loss_fn(output, micro_batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        extras = micro_batch.extras
        mask = micro_batch.response_mask.to(output.values.dtype)
        result = compute_value_loss(
            vpreds=output.values,
            values=extras["values"],
            returns=extras["returns"],
            response_mask=mask,
            cliprange_value=cfg.cliprange_value,
            agg=agg,
        )
        metrics = {
            "critic/vf_loss": result.loss.detach(),
            "critic/vf_clipfrac": result.vf_clipfrac,
            "critic/vpred_mean": token_mean(output.values.detach(), mask),
        }
        return result.loss, metrics

    return loss_fn
