"""Rank function of the rollout-correction data-parallel test: a real ``PolicyWorker`` (tiny llama,
Megatron on gloo) updates on a fixed batch through the role handle of the torchrun mode.

The batch's rollout log-probs are the worker's own log-probs minus ``LOG_RATIO``, so the per-token
log-ratio ``ℓ = log π_old - log μ`` the correction sees is ``LOG_RATIO`` (to float32 rounding) and
which tokens the rejection drops is written down by hand in ``KEEP``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import distributed as dist
from transformers import AutoConfig

from rltrain.config import ActorConfig, RLConfig
from rltrain.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
from rltrain.config.model import ModelConfig
from rltrain.config.optim import OptimConfig
from rltrain.config.rollout import RolloutConfig
from rltrain.config.trainer import ClusterConfig
from rltrain.data.step_batch import StepBatch
from rltrain.orchestrator.placement import rollout_placement
from rltrain.trainer.roles import _DataParallelRole
from rltrain.orchestrator.spmd import SPMDGroup
from rltrain.trainer.algorithms import build_algorithm
from rltrain.workers.model_workers import PolicyWorker

PROMPT_LEN, RESPONSE_LEN = 5, 6
RESPONSE_LENGTHS = (6, 4, 5, 6, 3, 6, 5, 2)
MINI_BATCH = 4
"""Two mini-batches (rows 0-3, 4-7); at DP=2 rank 0 gets rows 0-1 and 4-5, rank 1 rows 2-3 and 6-7."""

IS_THRESHOLD = 1.5
"""``rollout_is=token``: weights min(r, 1.5); r > 1.5 where ℓ > log 1.5 = 0.405."""
RS, RS_THRESHOLD = "token_k1,seq_max_k2", "0.6_1.8,0.3"
"""A token is dropped when r ∉ [0.6, 1.8] (ℓ < -0.511 or ℓ > 0.588); a whole row when one of its
tokens has ½ℓ² > 0.3 (|ℓ| > 0.775)."""

_SMALL = [[0.02 * ((3 * row + col) % 5 - 2) for col in range(RESPONSE_LEN)] for row in range(8)]
"""|ℓ| <= 0.04 everywhere else: kept, not truncated."""
PADDING_LOG_RATIO = 3.0
"""On padding: it would be rejected and truncated if padding were counted."""
_OUTLIERS = {
    (2, 1): 0.7,  # rank 1: dropped by token_k1, truncated; the largest weight of mini-batch 0
    (2, 3): 0.5,  # kept, truncated
    (3, 4): -0.6,  # dropped by token_k1; the smallest weight (0.549) of mini-batch 0
    (4, 0): -0.9,  # rank 0: ½ℓ² = 0.405 > 0.3 drops all of row 4; smallest weight of mini-batch 1
    (6, 2): 0.45,  # rank 1: kept, truncated: the largest weight of mini-batch 1
    (7, 0): -0.55,  # row 7 (two tokens) loses both to token_k1: no kept token left in it
    (7, 1): -0.55,
}


def _table(values: list[list[float]], outliers: dict[tuple[int, int], float]) -> torch.Tensor:
    table = torch.tensor(values, dtype=torch.float64)
    for (row, col), value in outliers.items():
        table[row, col] = value
    for row, length in enumerate(RESPONSE_LENGTHS):
        table[row, length:] = PADDING_LOG_RATIO
    return table


LOG_RATIO = _table(_SMALL, _OUTLIERS)
"""[8, RESPONSE_LEN] ℓ per token."""


def _keep() -> torch.Tensor:
    keep = torch.zeros(LOG_RATIO.shape)
    for row, length in enumerate(RESPONSE_LENGTHS):
        keep[row, :length] = 1
    keep[2, 1] = keep[3, 4] = 0  # token_k1
    keep[4, :] = keep[7, :] = 0  # seq_max_k2 (row 4), token_k1 on both tokens (row 7)
    return keep


KEEP = _keep()
"""[8, RESPONSE_LEN] 1 on the valid tokens the rejection keeps, by hand from ``_OUTLIERS``."""


def _config(world: int, correction: RolloutCorrectionConfig | None, tis_cap: float | None) -> RLConfig:
    return RLConfig(
        model=ModelConfig(dtype="float32"),
        actor=ActorConfig(
            ppo_mini_batch_size=MINI_BATCH,
            ppo_micro_batch_size_per_gpu=1,
            loss_agg_mode="seq-mean-token-mean",
            entropy_coeff=0.01,
            tis_imp_ratio_cap=tis_cap,
            optim=OptimConfig(lr=1e-3, weight_decay=0.0),
        ),
        algorithm=AlgorithmConfig(rollout_correction=correction),
        rollout=RolloutConfig(mode="separate", num_devices=1),
        cluster=ClusterConfig(n_gpus_per_node=world),
    )


def _batch(vocab_size: int) -> StepBatch:
    """Eight left-padded prompts with right-padded responses of ``RESPONSE_LENGTHS``."""
    gen = torch.Generator().manual_seed(7)
    rows = len(RESPONSE_LENGTHS)
    mask = torch.ones(rows, PROMPT_LEN + RESPONSE_LEN, dtype=torch.long)
    for row, length in enumerate(RESPONSE_LENGTHS):
        mask[row, : row % 3] = 0
        mask[row, PROMPT_LEN + length :] = 0
    input_ids = torch.randint(1, vocab_size, mask.shape, generator=gen) * mask
    return StepBatch(
        input_ids=input_ids,
        attention_mask=mask,
        response_len=RESPONSE_LEN,
        group_ids=torch.arange(rows),
        rollout_logprobs=torch.zeros(rows, RESPONSE_LEN),
        data_sources=["test"] * rows,
        ground_truths=[""] * rows,
        finish_reasons=["stop"] * rows,
        uids=[f"p{row}-s0" for row in range(rows)],
        advantages=torch.randn(rows, RESPONSE_LEN, generator=gen),
    )


class _ActorUpdates(_DataParallelRole):
    """The data-parallel dispatch of ``PolicyRole.update`` (which also needs rollout engines)."""

    metric_prefix = "actor"


def actor_worker(config: RLConfig, model_dir: str, ctx=None) -> PolicyWorker:
    """The policy worker of ``config`` on this process's rank, for a one-step run."""
    return PolicyWorker(
        config,
        model_dir,
        None,
        total_steps=1,
        placement=rollout_placement(config, gpu=False),
        reference=build_algorithm(config).needs.reference,
        ctx=ctx,
    )


def _update(config: RLConfig, model_dir: str, batch: StepBatch, ctx=None) -> dict[str, Any]:
    """Build an actor, update it on ``batch`` (two mini-batches), and what to compare."""
    worker = actor_worker(config, model_dir, ctx=ctx)
    old, _, _ = worker.compute_log_prob(batch)
    batch.old_logprobs = old
    batch.rollout_logprobs = old - LOG_RATIO.to(old.dtype)
    role = _ActorUpdates(SPMDGroup("actor", worker))
    minis = [batch.select(list(range(i, i + MINI_BATCH))) for i in range(0, batch.batch_size, MINI_BATCH)]
    steps = role._update("update_actor", minis, build_algorithm(config).actor_loss)
    after, _, _ = worker.compute_log_prob(batch)
    # numpy, pickled by value: a tensor would cross the queue as a shared-memory handle that
    # vanishes when this process exits before the parent reads it
    return {"worker": worker, "old_logprobs": old.numpy(), "steps": steps, "logprobs_after": after.numpy()}


def correction_case(model_dir: str, with_reference: bool) -> dict[str, Any]:
    """Per rank: the steps' metrics and the log-probs after them, with rejection and token IS on;
    ``with_reference`` (one rank) adds the same update without rejection on a batch whose response
    mask is ``KEEP`` (``actor.tis_imp_ratio_cap`` gives the same token IS weights)."""
    world = int(os.environ["WORLD_SIZE"])
    correction = RolloutCorrectionConfig(
        rollout_is="token",
        rollout_is_threshold=IS_THRESHOLD,
        rollout_rs=RS,
        rollout_rs_threshold=RS_THRESHOLD,
    )
    config = _config(world, correction, None)
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    batch = _batch(vocab_size)
    run = _update(config, model_dir, batch)
    out = {k: v for k, v in run.items() if k != "worker"}
    out["dp_size"] = run["worker"].ctx.dp_size
    if with_reference:
        reference = _batch(vocab_size)
        reference.sampled_mask = KEEP.clone()
        ref_run = _update(_config(world, None, IS_THRESHOLD), model_dir, reference, ctx=run["worker"].ctx)
        out["reference"] = {k: v for k, v in ref_run.items() if k != "worker"}
    dist.barrier()
    run["worker"].shutdown()
    return out
