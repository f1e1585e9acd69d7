"""Per-rank workers of the roles: plain Python classes; Ray (or torchrun) decides where they run.

``PolicyWorker`` hosts, on one rank, the actor's Megatron shard, the reference's shard (same layout,
same process: one Megatron parallel state per process) and, on engine ranks, a vLLM engine that
shares the rank's devices (the hybrid engine); weights reach it in place, never through disk.
``CriticWorker`` hosts the critic's shard. Methods take and return driver-side data
(:class:`StepBatch` slices, metric dicts); Megatron and vLLM are imported only here, lazily, so that
the driver process never loads them. What every rank shares is :mod:`~rltrain.workers.rank_base`;
the engine side and the separate engines' ``RolloutWorker``, :mod:`~rltrain.workers.rollout_worker`.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rltrain.algo.loss_agg import GlobalCounts
from rltrain.algo.loss_specs import ActorLoss, CriticLoss
from rltrain.algo.rollout_correction import CorrectionStats, RolloutCorrectionSpec, correction_stats
from rltrain.config import RLConfig
from rltrain.data.step_batch import StepBatch
from rltrain.orchestrator.placement import RolloutPlacement
from rltrain.workers.ppo_losses import actor_loss_fn, critic_loss_fn

if TYPE_CHECKING:
    pass

from rltrain.workers.rank_base import (
    MegatronRankBase,
    RankInfo,
    fused_head,
    load_hf_into,
    optimizer_steps,
    params_dtype_of,
    role_batching,
    step_metrics,
    token_batch,
)
from rltrain.workers.rollout_worker import build_engine, run_engine

log = logging.getLogger(__name__)


class PolicyWorker(MegatronRankBase):
    """Actor (+ reference, + colocated rollout engine) on one rank."""

    def __init__(
        self,
        config: RLConfig,
        model_dir: str,
        info: RankInfo | None,
        *,
        total_steps: int,
        placement: RolloutPlacement,
        reference: bool,
        ctx=None,
    ) -> None:
        """``placement``: the run's rollout layout (which ranks host an engine, its TP size);
        ``reference``: whether the run's algorithm needs the reference model (its KL penalty)."""
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
        dtype = params_dtype_of(config.model.dtype)
        fused = fused_head(config)
        self.actor = MegatronWorker(
            self.hf_config,
            ctx=self.ctx,
            role="actor",
            batching=role_batching(actor),
            forward_batching=role_batching(actor, micro_batch_size=actor.log_prob_micro_batch_size_per_gpu),
            optim=actor.optim,
            total_steps=optimizer_steps(
                config, total_steps, mini_batch_size=actor.ppo_mini_batch_size, epochs=actor.ppo_epochs
            ),
            recompute_activations=actor.recompute_activations,
            offload_optimizer=actor.optimizer_offload,
            params_dtype=dtype,
            fused=fused,
            moe=config.model.moe,
            router_replay=actor.router_replay.mode,
            train_mtp=config.model.mtp.enable_train,
            detach_mtp_inputs=config.model.mtp.detach_encoder,
        )
        load_hf_into(self.actor, ctx=self.ctx, hf_config=self.hf_config, model_dir=model_dir)
        self.ref = None
        if reference:
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
        """(group, device) of the weights' group of the engines on other devices (``rollout.mode:
        separate``), on the ranks that send into it."""
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
                PlannedExport(
                    chunks,
                    self.ctx,
                    bridge_for_chunks(self.hf_config, chunks, self.ctx),
                    converters=self.actor.converters,
                ),
                sync_config=self.config.rollout.weight_sync,
                mode=self.placement.mode,
                rank=self.ctx.rank,
                host_ranks=self.engine_ranks,
                engine_tp=self.placement.engine_tp,
                engine=self.engine,
                group=group,
                device=device,
                dtype=params_dtype_of(self.config.model.dtype),
                num_engines=self.placement.num_engines,
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
            return run_engine(self.engine, self.config, prompts, sampling)

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

    def connect_weight_sync(self, address: tuple[str, int], num_engines: int, num_senders: int) -> None:
        """Join the weights' group of the separate engines (``address``: its rendezvous, hosted by
        rank 0): the first ``num_senders`` trainer ranks (every rank for ``shard_to_shard``, rank 0
        for ``broadcast``) as group ranks 0.., the engines after them. Collective over the actor's
        ranks; a new group (engines restarted) takes effect at the next sync."""
        self._sender = None
        if self.ctx.rank < num_senders:
            from rltrain.weight_sync.broadcast import join_broadcast_group

            self._broadcast = join_broadcast_group(
                address,
                group_rank=self.ctx.rank,
                world_size=num_senders + num_engines,
                timeout_s=self.config.trainer.timeouts.collective_s,
            )

    def sync_weights(self, index: int | None = None) -> dict[str, float]:
        """Move the actor's weights to the engines (collective over the actor's ranks; see
        ``rltrain.weight_sync``); the metrics come from the rank that reports them. ``index``: the
        step whose weights these are (what the sampled verification rotates by)."""
        return self._weight_sender().sync(index)

    # ---- trainer forward / update ---------------------------------------------------------------
    def compute_log_prob(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(old log-probs, entropy), each [batch, response_len], and the routes the actor recorded
        ([batch, seq, layers, top_k]; ``actor.router_replay.mode=R2``, else None)."""
        out = self.actor.compute_log_prob(token_batch(batch))
        return out.logprobs, out.entropy, out.routed_experts

    def compute_ref_log_prob(self, batch: StepBatch) -> torch.Tensor:
        if self.ref is None:
            raise RuntimeError(
                "no reference model: neither algorithm.use_kl_in_reward nor actor.use_kl_loss is on"
            )
        return self.ref.compute_log_prob(token_batch(batch)).logprobs

    def update_actor(
        self, mini_batches: list[tuple[StepBatch, GlobalCounts]], loss: ActorLoss
    ) -> list[dict[str, float]]:
        """One optimizer step per (local mini-batch, its global counts) of the run's actor ``loss``;
        metrics per step."""
        correction = loss.correction
        results = []
        for local, counts in mini_batches:
            extra: dict[str, float] = {}
            if correction is not None and (correction.rejection or loss.log_correction_metrics):
                stats = self._correction_stats(local, correction)
                if correction.rejection:
                    counts = counts.kept(stats)
                if loss.log_correction_metrics:
                    extra = stats.metrics(correction)
            res = self.actor.update(token_batch(local, loss.inputs), actor_loss_fn(loss, counts))
            results.append(step_metrics("actor", res) | extra)
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


class CriticWorker(MegatronRankBase):
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
            total_steps=optimizer_steps(config, total_steps, mini_batch_size=mini, epochs=epochs),
            params_dtype=params_dtype_of(config.model.dtype),
            moe=config.model.moe,
        )
        load_hf_into(
            self.critic, ctx=self.ctx, hf_config=self.hf_config, model_dir=critic.model_path or model_dir
        )

    def compute_values(self, batch: StepBatch) -> torch.Tensor:
        return self.critic.compute_values(token_batch(batch))

    def update_critic(
        self, mini_batches: list[tuple[StepBatch, GlobalCounts]], loss: CriticLoss
    ) -> list[dict[str, float]]:
        """One optimizer step per (local mini-batch, its global counts) of the run's critic ``loss``."""
        results = []
        for local, counts in mini_batches:
            res = self.critic.update(token_batch(local, loss.inputs), critic_loss_fn(loss, counts))
            results.append(step_metrics("critic", res))
            self._log_trained("critic", len(results) - 1, len(mini_batches), local)
        return results

    def save_checkpoint(self, root: str, step: int) -> str:
        return str(self.critic.save_checkpoint(Path(root) / "critic", step=step))

    def load_checkpoint(self, root: str) -> int | None:
        return self.critic.load_checkpoint(Path(root) / "critic", load_optimizer=True)


class RewardModelWorker(MegatronRankBase):
    """Reward model (``reward.reward_model``: scalar head, forward only) on one rank; its weights come
    from ``reward.reward_model.model.path``, not the policy's ``model_dir``."""

    def __init__(self, config: RLConfig, model_dir: str, info: RankInfo | None, *, ctx=None) -> None:
        rm = config.reward.reward_model
        super().__init__(config, rm.model.path, info, rm.parallel, ctx)
        from rltrain.megatron.micro_batches import MicroBatching
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
            params_dtype=params_dtype_of(config.model.dtype),
        )
        load_hf_into(self.reward_model, ctx=self.ctx, hf_config=self.hf_config, model_dir=rm.model.path)

    def compute_rm_score(self, batch: StepBatch) -> torch.Tensor:
        return self.reward_model.compute_rm_scores(token_batch(batch))
