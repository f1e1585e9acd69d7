"""Rank function of the policy-loss test: one real ``PolicyWorker`` (tiny llama, Megatron on gloo,
packed micro-batches) takes one update per :class:`LossCase` on a fixed batch, through the role
handle of the torchrun mode.

Before each update the worker computes the batch's log-probs ``logp`` with its current weights;
the batch then gets ``old_logprobs = logp - LOG_RATIO`` and ``ref_logprobs = logp - REF_LOG_RATIO``,
so the PPO log-ratio the loss sees is ``LOG_RATIO`` and the KL loss's ``logp - ref`` is
``REF_LOG_RATIO`` (to float32 rounding), both written down by hand here. The batch is the
rollout-correction test's (eight left-padded prompts, ragged responses) with a sampled mask that
has gaps and one empty row; the update splits it into the micro-batches ``MICRO_SPLITS``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from rollout_correction_cases import RESPONSE_LEN, RESPONSE_LENGTHS, _ActorUpdates, _batch, _config, actor_worker
from transformers import AutoConfig

from rltrain.config import RLConfig
from rltrain.config.actor import PolicyLossConfig
from rltrain.orchestrator.placement import rollout_placement
from rltrain.orchestrator.spmd import SPMDGroup
from rltrain.trainer.algorithms import build_algorithm
from rltrain.workers.rank_base import token_batch
from rltrain.workers.model_workers import PolicyWorker

MICRO_BATCH = 3
MICRO_SPLITS = ([0, 1, 2], [3, 4, 5], [6, 7])
"""``ppo_micro_batch_size_per_gpu=3`` on eight rows: ragged micro-batches, the last with row 7 (empty)."""

ENTROPY_COEFF = 0.01

PADDING = 3.0
"""ℓ on padding and in the mask's gaps: it would be clipped (or dominate) if it were counted."""
_LOG_RATIO_ROWS = (
    (1.3, 0.05, 0.3, -0.1, -0.35, 0.02),  # 1.3 at A < 0: ratio 3.67 > clip_ratio_c, the dual clip
    (-0.25, 0.1, PADDING, -0.05),  # column 2 is a gap of the sampled mask
    (0.15, -0.3, 0.0, 0.25, -0.02),  # -0.3 at A < 0 and 0.25 at A > 0: clipped
    (-0.4, -0.45, -0.3, -0.5, -0.2, -0.35),  # row mean -0.37: GSPO's sequence ratio clipped low
    (0.6, 0.08, 1.5),  # 1.5 at A < 0: dual clip
    (0.1, PADDING, -PADDING, PADDING, -0.15, 0.22),  # columns 1-3 are a gap
    (0.03, 0.19, -0.06, 0.4, 0.0),
    (0.7, -0.7),  # masked out entirely (the empty row)
)


def _table() -> torch.Tensor:
    table = torch.full((len(RESPONSE_LENGTHS), RESPONSE_LEN), PADDING, dtype=torch.float64)
    for row, values in enumerate(_LOG_RATIO_ROWS):
        assert len(values) == RESPONSE_LENGTHS[row]
        table[row, : len(values)] = torch.tensor(values, dtype=torch.float64)
    return table


LOG_RATIO = _table()
"""[8, RESPONSE_LEN] ℓ = log π - log π_old per token."""

ADVANTAGES = torch.tensor(
    [
        [((2 * row + 3 * col) % 7 - 3) / 2 for col in range(RESPONSE_LEN)]
        for row in range(len(RESPONSE_LENGTHS))
    ],
    dtype=torch.float64,
)
"""[8, RESPONSE_LEN] advantages in {-1.5, -1, ..., 1.5}, signs mixed within each row."""

REF_LOG_RATIO = torch.tensor(
    [
        [0.1 * ((row + 2 * col) % 5) - 0.2 for col in range(RESPONSE_LEN)]
        for row in range(len(RESPONSE_LENGTHS))
    ],
    dtype=torch.float64,
)
"""[8, RESPONSE_LEN] κ = log π - log π_ref per token, in [-0.2, 0.2]."""


def _sampled_mask() -> torch.Tensor:
    mask = torch.zeros(LOG_RATIO.shape)
    for row, length in enumerate(RESPONSE_LENGTHS):
        mask[row, :length] = 1
    mask[1, 2] = 0
    mask[5, 1:4] = 0
    mask[7] = 0
    return mask


SAMPLED_MASK = _sampled_mask()
"""[8, RESPONSE_LEN] the tokens the policy sampled: gaps in rows 1 and 5 (e.g. tool output), row 7
none; 31 tokens in 7 sequences."""


@dataclass(frozen=True)
class LossCase:
    """One update: the actor settings that differ from the base config."""

    name: str
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """``loss_mode`` and the covariance losses' settings."""
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: int | None = None
    clip_ratio: float = 0.2
    clip_ratio_high: float | None = None
    kl_loss_type: str | None = None
    """None: no KL loss."""
    kl_loss_coef: float = 0.5
    per_micro_batch: bool = False
    """The loss picks tokens by micro-batch statistics (clip_cov, kl_cov): compare against the
    per-micro-batch reference instead of the one-piece one."""


CASES = (
    LossCase("vanilla/token-mean"),
    LossCase(
        "vanilla/seq-mean-token-sum-norm", loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=16
    ),
    LossCase("vanilla/token-sum", loss_agg_mode="token-sum"),
    LossCase("vanilla/kl-k3+", kl_loss_type="k3+"),
    LossCase("gspo", PolicyLossConfig("gspo")),
    LossCase("cispo", PolicyLossConfig("cispo"), clip_ratio_high=0.28),
    LossCase("geo_mean", PolicyLossConfig("geo_mean"), clip_ratio=0.4),
    # ratio 1: every candidate (covariance in (1, 3), not clipped) is cut, so torch.randperm's
    # draw in the worker does not decide which
    LossCase(
        "clip_cov", PolicyLossConfig("clip_cov", clip_cov_ratio=1.0, clip_cov_ub=3.0), per_micro_batch=True
    ),
    LossCase("kl_cov", PolicyLossConfig("kl_cov", kl_cov_ratio=0.2, ppo_kl_coef=1.0), per_micro_batch=True),
    LossCase("gpg", PolicyLossConfig("gpg"), loss_agg_mode="seq-mean-token-mean"),
    LossCase(
        "reinforce/seq-mean-token-sum-norm/kl-k1+",
        PolicyLossConfig("reinforce"),
        loss_agg_mode="seq-mean-token-sum-norm",
        loss_scale_factor=10,
        kl_loss_type="k1+",
    ),
)


def _actor_config(base: RLConfig, case: LossCase) -> RLConfig:
    actor = replace(
        base.actor,
        policy_loss=case.policy_loss,
        loss_agg_mode=case.loss_agg_mode,
        loss_scale_factor=case.loss_scale_factor,
        clip_ratio=case.clip_ratio,
        clip_ratio_high=case.clip_ratio_high,
        use_kl_loss=case.kl_loss_type is not None,
        kl_loss_type=case.kl_loss_type or base.actor.kl_loss_type,
        kl_loss_coef=case.kl_loss_coef,
    )
    return replace(base, actor=actor)


def policy_loss_updates(model_dir: str) -> dict[str, Any]:
    """One update per case on one rank: per case the inputs the loss saw and the step's metrics,
    plus the micro-batch split the worker used."""
    base = _config(1, None, None)
    base = replace(
        base,
        actor=replace(
            base.actor,
            ppo_mini_batch_size=len(RESPONSE_LENGTHS),
            ppo_micro_batch_size_per_gpu=MICRO_BATCH,
            entropy_coeff=ENTROPY_COEFF,
        ),
    )
    # The reference model is never asked for: the batch carries ``ref_logprobs`` set here.
    worker = actor_worker(base, model_dir)
    role = _ActorUpdates(SPMDGroup("actor", worker))
    batch = _batch(AutoConfig.from_pretrained(model_dir).vocab_size)
    batch.sampled_mask = SAMPLED_MASK.clone()
    batch.advantages = ADVANTAGES.float()
    out: dict[str, Any] = {"splits": worker.actor.batching.split(token_batch(batch)), "cases": {}}
    for case in CASES:
        logprobs, entropy, _ = worker.compute_log_prob(batch)
        batch.old_logprobs = logprobs - LOG_RATIO.to(logprobs.dtype)
        batch.ref_logprobs = logprobs - REF_LOG_RATIO.to(logprobs.dtype)
        config = _actor_config(base, case)
        (metrics,) = role._update("update_actor", [batch], build_algorithm(config).actor_loss)
        # numpy, pickled by value (a tensor would cross the queue as a shared-memory handle)
        out["cases"][case.name] = {
            "metrics": metrics,
            "logprobs": logprobs.numpy(),
            "entropy": entropy.numpy(),
            "old_logprobs": batch.old_logprobs.numpy(),
            "ref_logprobs": batch.ref_logprobs.numpy(),
        }
    out["response_mask"] = batch.response_mask.numpy()
    out["advantages"] = batch.advantages.numpy()
    worker.shutdown()
    return out
