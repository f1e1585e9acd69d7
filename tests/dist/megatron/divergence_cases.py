"""Rank functions of the divergence tests: a real Megatron train step of a tiny llama at TP=2."""

from __future__ import annotations

from typing import Any

import torch
from megatron_fixtures import SEED, ensure_process_group, make_batch, policy_loss, tiny_llama

from rltrain.config.optim import OptimConfig
from rltrain.config.parallel import ParallelConfig
from rltrain.errors import DivergenceError, NonFiniteWeightsError
from rltrain.megatron.parallel import ParallelContext
from rltrain.megatron.worker import MegatronWorker

TP2 = ParallelConfig(tensor_model_parallel_size=2)
WEIGHT_DECAY = 0.01
OVERFLOW_LR, OVERFLOW_WEIGHT_DECAY = 3e37, 100.0
"""AdamW scales each decayed parameter by 1 - lr·wd = -3e39 first: past float32's 3.4e38, every
nonzero element becomes infinite (a larger lr is refused by torch: lr / (1 - beta1) must fit)."""


def _local_max_abs(worker: MegatronWorker) -> float:
    return max(float(p.detach().abs().max()) for _, p in worker.named_parameters())


def _actor(lr: float, weight_decay: float = WEIGHT_DECAY) -> tuple[ParallelContext, MegatronWorker]:
    ensure_process_group()
    ctx = ParallelContext.initialize(TP2, seed=SEED)
    optim = OptimConfig(lr=lr, weight_decay=weight_decay, clip_grad=1.0, lr_warmup_steps=0)
    return ctx, MegatronWorker(
        tiny_llama(num_hidden_layers=2), ctx=ctx, role="actor", optim=optim, total_steps=4
    )


def divergence_case() -> dict[str, Any]:
    """Per rank: what a train step at lr=1e9 (finite, huge weights) and one whose decoupled weight
    decay overflows float32 (infinite weights) report, and what the weight export says of a NaN in
    rank 1's shard."""
    batch = make_batch(seed=4)
    loss_fn = policy_loss(float(batch.response_mask.sum()))
    out: dict[str, Any] = {}

    ctx, actor = _actor(1e9)
    out["huge_before_local_max"] = _local_max_abs(actor)
    result = actor.update(batch, loss_fn)
    out["huge_skipped"] = result.skipped
    out["huge_reported"] = result.param_max_abs
    out["huge_local_max"] = _local_max_abs(actor)
    ctx.destroy()

    ctx, actor = _actor(OVERFLOW_LR, weight_decay=OVERFLOW_WEIGHT_DECAY)
    try:
        actor.update(batch, loss_fn)
        out["infinite"] = "no error"
    except DivergenceError as err:
        out["infinite"] = str(err)
    ctx.destroy()

    from megatron_bridge.live import bridge_for_chunks
    from megatron_bridge.reshard import EngineLayout
    from rltrain.weight_sync import PlannedExport
    from rltrain.weight_sync.types import drain

    ctx, actor = _actor(1e-3)
    export = PlannedExport(
        actor.chunks, ctx, bridge_for_chunks(tiny_llama(num_hidden_layers=2), actor.chunks, ctx)
    )
    out["finite_sync_tensors"] = sum(1 for _ in export.regions(EngineLayout(tp=1), dst=0))
    if ctx.rank == 1:
        with torch.no_grad():
            dict(actor.named_parameters())["chunk0.decoder.layers.1.mlp.linear_fc2.weight"][0, 3] = float(
                "nan"
            )
    try:
        drain(export.regions(EngineLayout(tp=1), dst=0))
        out["nan_sync"] = "no error"
    except NonFiniteWeightsError as err:
        out["nan_sync"] = str(err)
    ctx.destroy()
    return out
