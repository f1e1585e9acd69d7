"""Per-rank workers of the roles: plain Python classes; Ray (or torchrun) decides where they run.

``PolicyWorker`` hosts, on one rank, the actor's Megatron shard, the reference's shard (same layout,
same process: one Megatron parallel state per process) and, on engine ranks, a vLLM engine that
shares the rank's devices (the hybrid engine); weights reach it in place, never through disk.
``CriticWorker`` hosts the critic's shard. Methods take and return driver-side data
(:class:`StepBatch` slices, metric dicts); Megatron and vLLM are imported only here, lazily, so that
the driver process never loads them.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rltrain.algo.rollout_correction import CorrectionStats, RolloutCorrectionSpec, correction_stats
from rltrain.algo.token_batch import TokenBatch
from rltrain.config import RLConfig
from rltrain.logging import metrics as mk
from rltrain.logging.samples import log_trained
from rltrain.orchestrator.batch import StepBatch
from rltrain.orchestrator.placement import RolloutPlacement
from rltrain.orchestrator.ppo_losses import GlobalCounts, actor_correction, actor_loss_fn, critic_loss_fn

if TYPE_CHECKING:
    from rltrain.megatron.train_step import TrainStepResult
    from rltrain.rollout.types import EngineSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankInfo:
    """Where a worker sits in its group's process group."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int = 0


def _init_env(info: RankInfo) -> None:
    os.environ.update(
        RANK=str(info.rank),
        WORLD_SIZE=str(info.world_size),
        LOCAL_RANK=str(info.local_rank),
        MASTER_ADDR=info.master_addr,
        MASTER_PORT=str(info.master_port),
    )


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _token_batch(batch: StepBatch, loss_inputs: tuple[str, ...] = ()) -> TokenBatch:
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


class _MegatronRankBase:
    """Shared set-up: process group, parallel context, HF config."""

    def __init__(self, config: RLConfig, model_dir: str, info: RankInfo | None, parallel, ctx=None) -> None:
        """``info`` sets the rendezvous environment (Ray); None keeps the launcher's (torchrun).
        ``ctx``: an existing parallel context to share (roles colocated in one process must have
        one layout: Megatron keeps one parallel state per process)."""
        if info is not None:
            _init_env(info)
        from transformers import AutoConfig

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
        self.hf_config = AutoConfig.from_pretrained(
            model_dir, trust_remote_code=config.model.trust_remote_code
        )

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
    from rltrain.megatron.forward import MicroBatching

    return MicroBatching(
        micro_batch_size=micro_batch_size or role_cfg.ppo_micro_batch_size_per_gpu or 1,
        use_dynamic_bsz=role_cfg.use_dynamic_bsz,
        max_token_len=role_cfg.ppo_max_token_len_per_gpu,
        use_remove_padding=getattr(role_cfg, "use_remove_padding", True),
    )


def _fused_head(config: RLConfig):
    """The fused log-prob head of ``model.use_fused_kernels`` (``model.fused_kernel_options``), or None."""
    if not config.model.use_fused_kernels:
        return None
    from rltrain.megatron.forward import FusedHead

    options = config.model.fused_kernel_options
    return FusedHead(impl=options.impl_backend, chunk_size=options.chunk_size)


def _optimizer_steps(config: RLConfig, total_steps: int, *, mini_batch_size: int, epochs: int) -> int:
    return total_steps * (config.data.train_batch_size // mini_batch_size) * epochs


class PolicyWorker(_MegatronRankBase):
    """Actor (+ reference, + colocated rollout engine) on one rank."""

    def __init__(
        self,
        config: RLConfig,
        model_dir: str,
        info: RankInfo | None,
        *,
        total_steps: int,
        placement: RolloutPlacement,
        ctx=None,
    ) -> None:
        """``placement``: the run's rollout layout (which ranks host an engine, its TP size)."""
        super().__init__(config, model_dir, info, config.actor.parallel, ctx)
        if len(placement.trainer_bundles) != self.ctx.world_size:
            raise ValueError(
                f"rollout placement is for {len(placement.trainer_bundles)} trainer ranks, "
                f"the actor has {self.ctx.world_size}"
            )
        self.placement = placement
        self.engine_ranks = list(placement.engine_ranks)
        """Ranks that host a colocated engine (``placement.engine_ranks`` as a list)."""
        engine_rank = self.ctx.rank in self.engine_ranks
        from rltrain.megatron.worker import MegatronWorker

        actor = config.actor
        dtype = _dtype(config.model.dtype)
        fused = _fused_head(config)
        self.actor = MegatronWorker(
            self.hf_config,
            ctx=self.ctx,
            role="actor",
            batching=role_batching(actor),
            forward_batching=role_batching(actor, micro_batch_size=actor.log_prob_micro_batch_size_per_gpu),
            optim=actor.optim,
            total_steps=_optimizer_steps(
                config, total_steps, mini_batch_size=actor.ppo_mini_batch_size, epochs=actor.ppo_epochs
            ),
            recompute_activations=actor.recompute_activations,
            offload_optimizer=actor.optimizer_offload,
            params_dtype=dtype,
            fused=fused,
            moe=config.model.moe,
            router_replay=actor.router_replay.mode,
        )
        load_hf_into(self.actor, ctx=self.ctx, hf_config=self.hf_config, model_dir=model_dir)
        self.ref = None
        if config.algorithm.use_kl_in_reward or actor.use_kl_loss:
            micro = config.ref.log_prob_micro_batch_size_per_gpu
            self.ref = MegatronWorker(
                self.hf_config,
                ctx=self.ctx,
                role="reference",
                batching=role_batching(actor, micro_batch_size=micro),
                params_dtype=dtype,
                fused=fused,
                moe=config.model.moe,
                router_replay=actor.router_replay.mode,
            )
            load_hf_into(self.ref, ctx=self.ctx, hf_config=self.hf_config, model_dir=model_dir)
        self.engine = build_engine(config, model_dir) if engine_rank else None
        self._broadcast: tuple[Any, Any] | None = None
        """(group, device) of the broadcast to engines on other devices (``rollout.mode: separate``),
        on rank 0."""
        self._sender: Any = None
        """The actor's ``rltrain.weight_sync.WeightSender`` (built at the first sync: collective)."""

    def _weight_sender(self):
        """The actor's ``WeightSender``: its ``PlannedExport`` and the configured transport."""
        if self._sender is None:
            from megatron_bridge.live import bridge_for_chunks
            from rltrain.weight_sync import PlannedExport, build_sender

            chunks = self.actor.chunks
            group, device = self._broadcast or (None, "cpu")
            self._sender = build_sender(
                PlannedExport(chunks, self.ctx, bridge_for_chunks(self.hf_config, chunks, self.ctx)),
                sync_config=self.config.rollout.weight_sync,
                mode=self.placement.mode,
                rank=self.ctx.rank,
                host_ranks=self.engine_ranks,
                engine_tp=self.placement.engine_tp,
                engine=self.engine,
                group=group,
                device=device,
                dtype=_dtype(self.config.model.dtype),
            )
        return self._sender

    # ---- rollout ---------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling) -> Any:
        """Sample on this rank's engine; with ``actor.param_offload`` the trainer's parameters leave
        the device while the engine runs (every rank, since engine workers may span them)."""
        with self._params_offloaded():
            if not prompts:
                return None
            if self.engine is None:
                raise RuntimeError(f"rank {self.ctx.rank} hosts no rollout engine")
            return _run_engine(self.engine, self.config, prompts, sampling)

    @contextmanager
    def _params_offloaded(self):
        models = (
            [m for m in (self.actor, self.ref) if m is not None] if self.config.actor.param_offload else []
        )
        for model in models:
            model.offload_to_cpu()
        try:
            yield
        finally:
            for model in models:
                model.reload_to_device()

    def connect_weight_sync(self, address: tuple[str, int] | None, num_engines: int) -> None:
        """Rank 0 joins the broadcast group of the separate engines (``address`` = its rendezvous)."""
        if address is not None:
            from rltrain.weight_sync.broadcast import join_broadcast_group

            self._broadcast = join_broadcast_group(
                address,
                group_rank=0,
                world_size=1 + num_engines,
                timeout_s=self.config.trainer.timeouts.collective_s,
            )

    def sync_weights(self) -> dict[str, float]:
        """Move the actor's weights to the engines (collective over the actor's ranks; see
        ``rltrain.weight_sync``); the metrics come from the rank that reports them."""
        return self._weight_sender().sync()

    # ---- trainer forward / update ---------------------------------------------------------------
    def compute_log_prob(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(old log-probs, entropy), each [batch, response_len], and the routes the actor recorded
        ([batch, seq, layers, top_k]; ``actor.router_replay.mode=R2``, else None)."""
        out = self.actor.compute_log_prob(_token_batch(batch))
        return out.logprobs, out.entropy, out.routed_experts

    def compute_ref_log_prob(self, batch: StepBatch) -> torch.Tensor:
        if self.ref is None:
            raise RuntimeError(
                "no reference model: neither algorithm.use_kl_in_reward nor actor.use_kl_loss is on"
            )
        return self.ref.compute_log_prob(_token_batch(batch)).logprobs

    def update_actor(self, mini_batches: list[tuple[StepBatch, GlobalCounts]]) -> list[dict[str, float]]:
        """One optimizer step per (local mini-batch, its global counts); metrics per step."""
        loss_inputs = ("old_logprobs", "advantages")
        if self.config.actor.use_kl_loss:
            loss_inputs += ("ref_logprobs",)
        correction = actor_correction(self.config.actor, self.config.algorithm)
        if correction is not None:
            loss_inputs += ("rollout_logprobs",)
        results = []
        for local, counts in mini_batches:
            extra: dict[str, float] = {}
            if correction is not None and (correction.spec.rejection or correction.log_metrics):
                stats = self._correction_stats(local, correction.spec)
                if correction.spec.rejection:
                    counts = counts.kept(stats)
                if correction.log_metrics:
                    extra = stats.metrics(correction.spec)
            loss_fn = actor_loss_fn(
                self.config.actor, counts, correction=None if correction is None else correction.spec
            )
            res = self.actor.update(_token_batch(local, loss_inputs), loss_fn)
            results.append(_step_metrics("actor", res) | extra)
            self._log_trained("actor", len(results) - 1, len(mini_batches), local)
        return results

    def _correction_stats(self, local: StepBatch, spec: RolloutCorrectionSpec) -> CorrectionStats:
        """Rollout-correction statistics of the whole mini-batch: this rank's part, summed (maxima:
        max) over the data-parallel group."""
        stats = correction_stats(local.old_logprobs, local.rollout_logprobs, local.response_mask, spec)
        if self.ctx.dp_size == 1:
            return stats
        import torch.distributed as dist

        sums, maxima = stats.sums.to(self.ctx.device), stats.maxima.to(self.ctx.device)
        dist.all_reduce(sums, group=self.ctx.groups.dp)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.ctx.groups.dp)
        return CorrectionStats(sums=sums.cpu(), maxima=maxima.cpu())

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, root: str, step: int) -> str:
        """``root/actor``: the Megatron checkpoint, and ``hf/`` with the model's config and tokenizer
        files, so that ``rltrain convert mcore-to-hf root/actor OUT`` exports it as it stands."""
        path = self.actor.save_checkpoint(Path(root) / "actor", step=step)
        if self.ctx.rank == 0:
            from megatron_bridge.hf_io import copy_hf_aux_files

            copy_hf_aux_files(self.model_dir, Path(root) / "actor" / "hf")
        return str(path)

    def load_checkpoint(self, root: str) -> int | None:
        return self.actor.load_checkpoint(Path(root) / "actor", load_optimizer=True)


class CriticWorker(_MegatronRankBase):
    """Critic (value model) on one rank."""

    def __init__(
        self, config: RLConfig, model_dir: str, info: RankInfo | None, *, total_steps: int, ctx=None
    ) -> None:
        super().__init__(config, model_dir, info, config.critic.parallel, ctx)
        from rltrain.megatron.worker import MegatronWorker

        critic = config.critic
        mini = critic.ppo_mini_batch_size or config.actor.ppo_mini_batch_size
        epochs = critic.ppo_epochs or config.actor.ppo_epochs
        self.critic = MegatronWorker(
            self.hf_config,
            ctx=self.ctx,
            role="critic",
            batching=role_batching(critic),
            forward_batching=role_batching(critic, micro_batch_size=critic.forward_micro_batch_size_per_gpu),
            optim=critic.optim,
            total_steps=_optimizer_steps(config, total_steps, mini_batch_size=mini, epochs=epochs),
            params_dtype=_dtype(config.model.dtype),
            moe=config.model.moe,
        )
        load_hf_into(
            self.critic, ctx=self.ctx, hf_config=self.hf_config, model_dir=critic.model_path or model_dir
        )

    def compute_values(self, batch: StepBatch) -> torch.Tensor:
        return self.critic.compute_values(_token_batch(batch))

    def update_critic(self, mini_batches: list[tuple[StepBatch, GlobalCounts]]) -> list[dict[str, float]]:
        results = []
        for local, counts in mini_batches:
            loss_fn = critic_loss_fn(
                self.config.critic, counts, actor_loss_scale_factor=self.config.actor.loss_scale_factor
            )
            res = self.critic.update(_token_batch(local, ("values", "returns")), loss_fn)
            results.append(_step_metrics("critic", res))
            self._log_trained("critic", len(results) - 1, len(mini_batches), local)
        return results

    def save_checkpoint(self, root: str, step: int) -> str:
        return str(self.critic.save_checkpoint(Path(root) / "critic", step=step))

    def load_checkpoint(self, root: str) -> int | None:
        return self.critic.load_checkpoint(Path(root) / "critic", load_optimizer=True)


class RewardModelWorker(_MegatronRankBase):
    """Reward model (``reward.reward_model``: scalar head, forward only) on one rank; its weights come
    from ``reward.reward_model.model.path``, not the policy's ``model_dir``."""

    def __init__(self, config: RLConfig, model_dir: str, info: RankInfo | None, *, ctx=None) -> None:
        rm = config.reward.reward_model
        super().__init__(config, rm.model.path, info, rm.parallel, ctx)
        from rltrain.megatron.forward import MicroBatching
        from rltrain.megatron.worker import MegatronWorker

        self.reward_model = MegatronWorker(
            self.hf_config,
            ctx=self.ctx,
            role="reward",
            batching=MicroBatching(
                micro_batch_size=rm.micro_batch_size_per_gpu,
                use_dynamic_bsz=rm.use_dynamic_bsz,
                max_token_len=rm.forward_max_token_len_per_gpu,
            ),
            params_dtype=_dtype(config.model.dtype),
        )
        load_hf_into(self.reward_model, ctx=self.ctx, hf_config=self.hf_config, model_dir=rm.model.path)

    def compute_rm_score(self, batch: StepBatch) -> torch.Tensor:
        return self.reward_model.compute_rm_scores(_token_batch(batch))


def engine_settings(config: RLConfig) -> EngineSettings:
    """The engine settings of ``config``: ``rollout``'s, the context length from the data if unset,
    the model's dtype, and the routed experts asked for under ``actor.router_replay.mode=R3``."""
    from rltrain.rollout.types import EngineSettings

    max_len = config.rollout.max_model_len or config.data.max_prompt_length + config.rollout.response_length
    return replace(
        EngineSettings.from_rollout_config(config.rollout),
        max_model_len=max_len,
        dtype=config.model.dtype,
        return_routed_experts=config.actor.router_replay.mode == "R3",
    )


def build_engine(config: RLConfig, model_dir: str):
    """The vLLM engine of ``config.rollout`` for ``model_dir``: ``AsyncRolloutEngine`` where
    ``rollout.uses_async_engine()`` (with ``rollout.partial_rollout``), else the offline
    ``RolloutEngine``, with :func:`engine_settings`."""
    from rltrain.rollout.engine import RolloutEngine

    settings = engine_settings(config)
    if config.rollout.uses_async_engine():
        from rltrain.rollout.async_engine import AsyncRolloutEngine

        return AsyncRolloutEngine(
            model_dir, settings=settings, partial_rollout=config.rollout.partial_rollout
        )
    return RolloutEngine(model_dir, settings=settings)


class RolloutWorker:
    """A vLLM engine on its own devices (``rollout.mode: separate``); weights arrive by broadcast."""

    def __init__(self, config: RLConfig, model_dir: str, info: RankInfo) -> None:
        self.config = config
        self.rank = info.rank
        self.engine = build_engine(config, model_dir)
        self.receiver: Any = None
        """This engine's end of the broadcast (``rltrain.weight_sync.broadcast``)."""
        self.batches: Any = None
        """The pipeline's queued batches with ``rollout.partial_rollout`` (built at the first)."""

    def connect_weight_sync(self, address: tuple[str, int], num_engines: int) -> None:
        from rltrain.weight_sync.broadcast import BroadcastTransport, join_broadcast_group

        group, device = join_broadcast_group(
            address,
            group_rank=1 + self.rank,
            world_size=1 + num_engines,
            timeout_s=self.config.trainer.timeouts.collective_s,
        )
        bucket_bytes = self.config.rollout.weight_sync.bucket_size_mb << 20
        self.receiver = BroadcastTransport(group=group, src_rank=0, bucket_bytes=bucket_bytes, device=device)

    def receive_weights(self, version: int | None = None) -> dict[str, float]:
        """Load the broadcast weights. ``version`` (the pipeline with ``rollout.partial_rollout``): the
        policy version they are, loaded through ``AsyncRolloutEngine.weight_update`` so that batches
        in flight pause (or finish) around the load and label their tokens; equal to the engine's
        version (the run's first send) it is a plain load, nothing being in flight."""
        from rltrain.rollout.partial import load_as_version

        stats = load_as_version(self.engine, version, lambda: self.receiver.receive(self.engine))
        return {
            mk.WEIGHT_SYNC_RECEIVE_SECONDS: stats.seconds,
            mk.WEIGHT_SYNC_BUCKETS: float(stats.num_buckets),
        }

    def generate(self, prompts: list[list[int]], sampling) -> Any:
        return _run_engine(self.engine, self.config, prompts, sampling) if prompts else None

    def generate_timed(self, prompts: list[list[int]], sampling) -> tuple[Any, float]:
        """:meth:`generate` and the seconds it took on this engine (``trainer.pipeline``'s engine
        busy time; measured here, so no clocks of two machines are compared)."""
        started = time.perf_counter()
        output = self.generate(prompts, sampling)
        return output, time.perf_counter() - started

    def queue_batch(self, prompts: list[list[int]], sampling) -> int | None:
        """Queue a batch on this engine (:class:`~rltrain.rollout.partial.BatchQueue`) and return its
        key at once (None: no prompts for this engine); weights may arrive while it generates."""
        if not prompts:
            return None
        if self.batches is None:
            from rltrain.rollout.partial import BatchQueue

            self.batches = BatchQueue(self.engine)
        return self.batches.submit(prompts, sampling)

    def batch_result(self, key: int | None) -> tuple[Any, float]:
        """The output of the batch queued as ``key`` (with per-token versions) and the seconds it
        generated on this engine."""
        return (None, 0.0) if key is None else self.batches.result(key)

    def rank_info(self) -> dict[str, int]:
        return {"rank": self.rank}


def _run_engine(engine, config: RLConfig, prompts: list, sampling) -> Any:
    """Wake the engine, sample (token-id prompts), or run the agent loop (``AgentPrompt``s, with
    ``rollout.multi_turn.enable``), and (``rollout.free_cache_engine``) put it back to sleep."""
    engine.wake_up()
    if config.rollout.multi_turn.enable:
        output = _agent_loop(engine, config).generate(prompts, sampling)
    else:
        output = engine.generate(prompts, sampling)
    if config.rollout.free_cache_engine:
        engine.sleep()
    return output


def _agent_loop(engine, config: RLConfig):
    """The engine's agent loop (its tools and interaction), built at the first multi-turn rollout."""
    loop = getattr(engine, "agent_loop", None)
    if loop is None:
        from rltrain.agent.loop import AgentLoop

        loop = engine.agent_loop = AgentLoop.from_config(engine, config.rollout.multi_turn)
    return loop


def _step_metrics(role: str, result: TrainStepResult) -> dict[str, float]:
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
