"""What every Megatron rank of a role shares: its place in the run (:class:`RankInfo`), the process
environment, the rank base class (parallel context, sample tracing, shutdown), loading HF weights
into a worker, the micro-batching and fused-head settings a role's config asks for, and the
metrics of a train step. Megatron is imported lazily, so that the driver process never loads it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rltrain.algo.token_batch import TokenBatch
from rltrain.config import RLConfig
from rltrain.data.step_batch import StepBatch
from rltrain.logging import metrics as mk
from rltrain.logging.samples import log_trained

if TYPE_CHECKING:
    from rltrain.megatron.train_step import TrainStepResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankInfo:
    """Where a worker sits in its group's process group."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int = 0


def init_env(info: RankInfo) -> None:
    os.environ.update(
        RANK=str(info.rank),
        WORLD_SIZE=str(info.world_size),
        LOCAL_RANK=str(info.local_rank),
        MASTER_ADDR=info.master_addr,
        MASTER_PORT=str(info.master_port),
    )


def params_dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def token_batch(batch: StepBatch, loss_inputs: tuple[str, ...] = ()) -> TokenBatch:
    """The rows of ``batch`` plus the named ``loss_inputs`` (fields of both batches) the loss reads."""
    tensors = {}
    for name in loss_inputs:
        value = getattr(batch, name)
        if value is None:
            raise ValueError(f"StepBatch.{name} is needed here but was not computed")
        tensors[name] = value
    return TokenBatch(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        response_len=batch.response_len,
        sampled_mask=batch.sampled_mask,
        routed_experts=batch.routed_experts,
        **tensors,
    )


def load_hf_into(worker, *, ctx, hf_config, model_dir: str) -> None:
    """Fill a Megatron role's chunks from the HF checkpoint in ``model_dir`` through the bridge.

    A critic's value head has no HF counterpart: it keeps its seeded initialisation (as verl's
    critic does) and is hidden from the bridge while the body loads. A reward model
    (``role="reward"``) loads all of an HF ``*ForSequenceClassification`` checkpoint, its
    ``score.weight`` into the scalar head; a checkpoint without one, or with num_labels != 1, raises
    ``megatron_bridge.errors.CheckpointError`` naming ``model_dir``. A trained role's optimizer then
    takes the loaded weights as its main copies (a bf16 optimizer made its fp32 copies of the
    initialisation; its first step would otherwise write them back).
    """
    from megatron_bridge.hf_io import HFCheckpointReader
    from megatron_bridge.live import bridge_for_chunks, load_hf_weights

    chunks = worker.chunks
    heads = [
        (c, c.output_layer)
        for c in chunks
        if worker.role == "critic" and getattr(c, "output_layer", None) is not None
    ]
    for chunk, _ in heads:
        chunk.output_layer = None
    try:
        bridge = bridge_for_chunks(hf_config, chunks, ctx, head="score" if worker.role == "reward" else "lm")
        load_hf_weights(chunks, ctx, bridge, HFCheckpointReader(model_dir))
    finally:
        for chunk, head in heads:
            chunk.output_layer = head
    optimizer = getattr(worker, "optimizer", None)
    if optimizer is not None:  # bf16/fp16: the optimizer's fp32 main copies were made before the load
        optimizer.reload_model_params()


class MegatronRankBase:
    """Shared set-up: process group, parallel context, HF config."""

    def __init__(self, config: RLConfig, model_dir: str, info: RankInfo | None, parallel, ctx=None) -> None:
        """``info`` sets the rendezvous environment (Ray); None keeps the launcher's (torchrun).
        ``ctx``: an existing parallel context to share (roles colocated in one process must have
        one layout: Megatron keeps one parallel state per process)."""
        if info is not None:
            init_env(info)
        from megatron_bridge.hf_config import load_hf_config
        from rltrain.megatron.parallel import ParallelContext

        self.config = config
        self.model_dir = model_dir
        if ctx is not None and ctx.parallel != parallel:
            raise ValueError(
                f"roles sharing a process need one parallel layout: {ctx.parallel} != {parallel}"
            )
        self.ctx = ctx or ParallelContext.initialize(
            parallel, seed=config.trainer.seed, timeout_minutes=config.trainer.timeouts.collective_s / 60
        )
        self.hf_config = load_hf_config(model_dir, trust_remote_code=config.model.trust_remote_code)

    def rank_info(self) -> dict[str, int]:
        c = self.ctx
        return dict(rank=c.rank, tp_rank=c.tp_rank, pp_rank=c.pp_rank, dp_rank=c.dp_rank, dp_size=c.dp_size)

    def _log_trained(self, role: str, index: int, count: int, local: StepBatch) -> None:
        """The run log's line of the sample ids this rank trained on in optimizer step ``index``
        (``trainer.log_samples``)."""
        if not self.config.trainer.log_samples:
            return
        c = self.ctx
        log_trained(
            role,
            rank=c.rank,
            dp_rank=c.dp_rank,
            dp_size=c.dp_size,
            mini_batch=index,
            num_mini_batches=count,
            uids=local.uids,
        )

    def shutdown(self) -> None:
        """Stop what this rank hosts (engine first, then Megatron's groups)."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.engine = None
        self.ctx.destroy()


def role_batching(role_cfg, *, micro_batch_size: int | None = None):
    """The ``MicroBatching`` of an actor or critic config section (``micro_batch_size``: a forward
    pass's own size, e.g. ``log_prob_micro_batch_size_per_gpu``; None: ``ppo_micro_batch_size_per_gpu``)."""
    from rltrain.megatron.micro_batches import MicroBatching

    return MicroBatching(
        micro_batch_size=micro_batch_size or role_cfg.ppo_micro_batch_size_per_gpu or 1,
        use_dynamic_bsz=role_cfg.use_dynamic_bsz,
        max_token_len=role_cfg.ppo_max_token_len_per_gpu,
        use_remove_padding=getattr(role_cfg, "use_remove_padding", True),
    )


def fused_head(config: RLConfig):
    """The fused log-prob head of ``model.use_fused_kernels`` (``model.fused_kernel_options``), or None."""
    if not config.model.use_fused_kernels:
        return None
    from rltrain.megatron.head_outputs import FusedHead

    options = config.model.fused_kernel_options
    return FusedHead(impl=options.impl_backend, chunk_size=options.chunk_size)


def optimizer_steps(config: RLConfig, total_steps: int, *, mini_batch_size: int, epochs: int) -> int:
    return total_steps * (config.data.train_batch_size // mini_batch_size) * epochs


def step_metrics(role: str, result: TrainStepResult) -> dict[str, float]:
    """A train step's metrics under the role's prefix (the backend reports the total as ``loss``),
    plus ``{role}/grad_norm``, ``{role}/lr``, ``{role}/skipped_steps``, ``{role}/param_max_abs``
    and an MoE model's router statistics (the actor's as ``moe/...``, the critic's as
    ``critic/moe/...``)."""
    metrics = {(k if "/" in k else f"{role}/{k}"): v for k, v in result.metrics.items()}
    prefix = "" if role == "actor" else f"{role}/"
    metrics |= {f"{prefix}{k}": v for k, v in result.moe_metrics.items()}
    return metrics | {
        f"{role}/{mk.GRAD_NORM}": result.grad_norm,
        f"{role}/{mk.LR}": result.lr,
        f"{role}/{mk.SKIPPED_STEPS}": float(result.skipped),
        f"{role}/{mk.PARAM_MAX_ABS}": result.param_max_abs,
    }
