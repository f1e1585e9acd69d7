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

from rltrain.algo.token_batch import TokenBatch
from rltrain.config import RLConfig
from rltrain.logging import metrics as mk
from rltrain.orchestrator.batch import StepBatch
from rltrain.orchestrator.placement import RolloutPlacement
from rltrain.orchestrator.ppo_losses import GlobalCounts, actor_loss_fn, critic_loss_fn

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
        **tensors,
    )


def load_hf_into(worker, *, ctx, hf_config, model_dir: str) -> None:
    """Fill a Megatron role's chunks from the HF checkpoint in ``model_dir`` through the bridge.

    A critic's value head has no HF counterpart: it keeps its seeded initialisation (as verl's
    critic does) and is hidden from the bridge while the body loads.
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
        bridge = bridge_for_chunks(hf_config, chunks, ctx)
        load_hf_weights(chunks, ctx, bridge, HFCheckpointReader(model_dir))
    finally:
        for chunk, head in heads:
            chunk.output_layer = head


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
        self.ctx = ctx or ParallelContext.initialize(parallel, seed=config.trainer.seed)
        self.hf_config = AutoConfig.from_pretrained(
            model_dir, trust_remote_code=config.model.trust_remote_code
        )

    def _batching(self, role_cfg, *, micro_batch_size: int | None = None):
        from rltrain.megatron.forward import MicroBatching

        return MicroBatching(
            micro_batch_size=micro_batch_size or role_cfg.ppo_micro_batch_size_per_gpu or 1,
            use_dynamic_bsz=role_cfg.use_dynamic_bsz,
            max_token_len=role_cfg.ppo_max_token_len_per_gpu,
            use_remove_padding=getattr(role_cfg, "use_remove_padding", True),
        )

    def rank_info(self) -> dict[str, int]:
        c = self.ctx
        return dict(rank=c.rank, tp_rank=c.tp_rank, pp_rank=c.pp_rank, dp_rank=c.dp_rank, dp_size=c.dp_size)

    def shutdown(self) -> None:
        """Stop what this rank hosts (engine first, then Megatron's groups)."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.engine = None
        self.ctx.destroy()


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
        self.actor = MegatronWorker(
            self.hf_config,
            ctx=self.ctx,
            role="actor",
            batching=self._batching(actor),
            optim=actor.optim,
            total_steps=_optimizer_steps(
                config, total_steps, mini_batch_size=actor.ppo_mini_batch_size, epochs=actor.ppo_epochs
            ),
            recompute_activations=actor.recompute_activations,
            offload_optimizer=actor.optimizer_offload,
            params_dtype=dtype,
        )
        load_hf_into(self.actor, ctx=self.ctx, hf_config=self.hf_config, model_dir=model_dir)
        self.ref = None
        if config.algorithm.use_kl_in_reward or actor.use_kl_loss:
            micro = config.ref.log_prob_micro_batch_size_per_gpu
            self.ref = MegatronWorker(
                self.hf_config,
                ctx=self.ctx,
                role="reference",
                batching=self._batching(actor, micro_batch_size=micro),
                params_dtype=dtype,
            )
            load_hf_into(self.ref, ctx=self.ctx, hf_config=self.hf_config, model_dir=model_dir)
        self.engine = build_engine(config, model_dir) if engine_rank else None
        self.transport = None
        """Broadcast transport to engines on other devices (``rollout.mode: separate``), on rank 0."""
        self._planned_export: Any = None
        """``PlannedExport`` of the actor (built at the first sync), or False where it does not apply."""

    def _export(self, dst: int):
        """HF-named full tensors of the actor, yielded on rank ``dst`` (collective: all ranks iterate).

        Built from the weight-sync plan (``rltrain.rollout.planned_export``): each planned slice comes
        point-to-point from the rank that owns it. The engine on ``dst`` loads them through vLLM,
        whose workers narrow each tensor themselves, so it is planned as one TP=1 engine rank (the
        whole tensors). Models the planner cannot describe (HF tensors that are themselves fused)
        use the bridge's full-tensor gather instead, said once in the log.
        """
        from megatron_bridge.live import bridge_for_chunks, export_hf_weights
        from rltrain.rollout.planner import EngineLayout

        planned = self._planned()
        if not planned:
            chunks = self.actor.chunks
            return export_hf_weights(
                chunks, self.ctx, bridge_for_chunks(self.hf_config, chunks, self.ctx), dst=dst
            )
        return planned.stream(EngineLayout(tp=1), 0, dst=dst)

    def _planned(self):
        """The actor's ``PlannedExport`` (built once, collective), or False where the planner does not apply."""
        if self._planned_export is None:
            from megatron_bridge.live import bridge_for_chunks
            from rltrain.rollout.planned_export import PlannedExport

            chunks = self.actor.chunks
            try:
                self._planned_export = PlannedExport(
                    chunks, self.ctx, bridge_for_chunks(self.hf_config, chunks, self.ctx)
                )
            except NotImplementedError as err:
                log.info("weight sync gathers whole tensors (export_hf_weights): %s", err)
                self._planned_export = False
        return self._planned_export

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
            self.transport = _broadcast_transport(
                self.config, address, group_rank=0, world_size=1 + num_engines
            )

    def sync_weights(self) -> dict[str, float]:
        """Stream the actor's weights (HF names, gathered over TP/PP/EP) to the engines.

        Collective over the actor's ranks. Colocated: one gather per engine, each into the engine of
        its rank; a CPU engine with TP>1 workers gets each worker's planned regions only. Separate:
        one gather onto rank 0, which broadcasts buckets to the engines.
        """
        start = time.perf_counter()
        stats = None
        bucket = self.config.rollout.weight_sync.bucket_size_mb << 20
        if self.config.rollout.mode == "separate":
            stream = self._export(dst=0)
            if self.transport is not None:
                stats = self.transport.send(stream)
            else:
                _drain(stream)
        tp = self.config.rollout.tensor_model_parallel_size
        for engine_rank in self.engine_ranks:
            host = engine_rank == self.ctx.rank
            if tp > 1 and self._planned() and not torch.cuda.is_available():
                # CPU workers in processes of their own: each takes its own planned regions only
                from rltrain.rollout.planner import EngineLayout

                regions = self._planned_export.rank_regions(EngineLayout(tp=tp), dst=engine_rank)
                if host:
                    stats = self.engine.load_rank_regions(regions, bucket_bytes=bucket)
                else:
                    _drain(regions)
                continue
            stream = self._export(dst=engine_rank)
            if host:
                stats = self.engine.load_weights(stream, bucket_bytes=bucket)
            else:
                _drain(stream)
        metrics = {}
        if stats is not None:
            metrics = {
                "weight_sync/seconds": time.perf_counter() - start,
                "weight_sync/gbytes": stats.num_bytes / 1e9,
                "weight_sync/num_tensors": float(stats.num_tensors),
            }
        if self.config.rollout.weight_sync.verify_checksums and self.engine_ranks:
            mismatched = self._verify_engine_weights()
            if stats is not None:
                metrics["weight_sync/checksum_mismatches"] = float(len(mismatched))
        return metrics

    def _verify_engine_weights(self) -> list[str]:
        """HF names whose engine digest differs from the trainer's (collective, like the sync)."""
        from rltrain.rollout.checksum import compare_digests, digests
        from rltrain.rollout.planner import EngineLayout

        tp = self.config.rollout.tensor_model_parallel_size
        if tp > 1 and not self._planned():
            log.warning("weight sync verification skipped: engine TP=%d needs the planned export", tp)
            return []
        mismatched: list[str] = []
        for engine_rank in self.engine_ranks:
            host = engine_rank == self.ctx.rank
            workers = self.engine.all_weights_digests() if host else [None] * tp
            for worker, engine in enumerate(workers):  # each TP worker against its own shard
                if tp == 1:
                    stream = self._export(dst=engine_rank)
                else:
                    stream = self._planned_export.shard_stream(EngineLayout(tp=tp), worker, dst=engine_rank)
                if not host:
                    _drain(stream)
                    continue
                expected = digests(stream, dtype=_dtype(self.config.model.dtype))
                problems = compare_digests({k: v for k, v in expected.items() if k in engine}, engine)
                mismatched += [f"engine worker {worker}: {p}" for p in problems]
            for problem in mismatched:
                log.error("weight sync verification (rank %d): %s", self.ctx.rank, problem)
        return mismatched

    # ---- trainer forward / update ---------------------------------------------------------------
    def compute_log_prob(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(old log-probs, entropy), each [batch, response_len]."""
        out = self.actor.compute_log_prob(_token_batch(batch))
        return out.logprobs, out.entropy

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
        if self.config.actor.tis_imp_ratio_cap is not None:
            loss_inputs += ("rollout_logprobs",)
        results = []
        for local, counts in mini_batches:
            res = self.actor.update(
                _token_batch(local, loss_inputs), actor_loss_fn(self.config.actor, counts)
            )
            results.append(_step_metrics("actor", res))
        return results

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
            batching=self._batching(critic),
            optim=critic.optim,
            total_steps=_optimizer_steps(config, total_steps, mini_batch_size=mini, epochs=epochs),
            params_dtype=_dtype(config.model.dtype),
        )
        load_hf_into(
            self.critic, ctx=self.ctx, hf_config=self.hf_config, model_dir=critic.model_path or model_dir
        )

    def compute_values(self, batch: StepBatch) -> torch.Tensor:
        return self.critic.compute_values(_token_batch(batch))

    def update_critic(self, mini_batches: list[tuple[StepBatch, GlobalCounts]]) -> list[dict[str, float]]:
        results = []
        for local, counts in mini_batches:
            res = self.critic.update(
                _token_batch(local, ("values", "returns")), critic_loss_fn(self.config.critic, counts)
            )
            results.append(_step_metrics("critic", res))
        return results

    def save_checkpoint(self, root: str, step: int) -> str:
        return str(self.critic.save_checkpoint(Path(root) / "critic", step=step))

    def load_checkpoint(self, root: str) -> int | None:
        return self.critic.load_checkpoint(Path(root) / "critic", load_optimizer=True)


def build_engine(config: RLConfig, model_dir: str):
    """The vLLM engine of ``config.rollout`` for ``model_dir`` (context length from the data if unset)."""
    from rltrain.rollout.engine import RolloutEngine
    from rltrain.rollout.types import EngineSettings

    settings = EngineSettings.from_rollout_config(config.rollout)
    max_len = config.rollout.max_model_len or config.data.max_prompt_length + config.rollout.response_length
    return RolloutEngine(
        model_dir, settings=replace(settings, max_model_len=max_len, dtype=config.model.dtype)
    )


def _broadcast_transport(config: RLConfig, address: tuple[str, int], *, group_rank: int, world_size: int):
    import torch

    from rltrain.rollout.transport import BroadcastTransport, standalone_group

    cuda = torch.cuda.is_available()
    group = standalone_group(
        host=address[0],
        port=address[1],
        rank=group_rank,
        world_size=world_size,
        backend="nccl" if cuda else "gloo",
    )
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return BroadcastTransport(
        group=group, src_rank=0, bucket_bytes=config.rollout.weight_sync.bucket_size_mb << 20, device=device
    )


class RolloutWorker:
    """A vLLM engine on its own devices (``rollout.mode: separate``); weights arrive by broadcast."""

    def __init__(self, config: RLConfig, model_dir: str, info: RankInfo) -> None:
        self.config = config
        self.rank = info.rank
        self.engine = build_engine(config, model_dir)
        self.transport = None

    def connect_weight_sync(self, address: tuple[str, int], num_engines: int) -> None:
        self.transport = _broadcast_transport(
            self.config, address, group_rank=1 + self.rank, world_size=1 + num_engines
        )

    def receive_weights(self) -> dict[str, float]:
        stats = self.transport.receive(self.engine)
        return {"weight_sync/receive_seconds": stats.seconds, "weight_sync/buckets": float(stats.num_buckets)}

    def generate(self, prompts: list[list[int]], sampling) -> Any:
        return _run_engine(self.engine, self.config, prompts, sampling) if prompts else None

    def rank_info(self) -> dict[str, int]:
        return {"rank": self.rank}


def _run_engine(engine, config: RLConfig, prompts: list[list[int]], sampling) -> Any:
    """Wake the engine, sample, and (``rollout.free_cache_engine``) put it back to sleep."""
    engine.wake_up()
    output = engine.generate(prompts, sampling)
    if config.rollout.free_cache_engine:
        engine.sleep()
    return output


def _step_metrics(role: str, result: TrainStepResult) -> dict[str, float]:
    """A train step's metrics under the role's prefix (the backend reports the total as ``loss``),
    plus ``{role}/grad_norm``, ``{role}/lr`` and ``{role}/skipped_steps``."""
    metrics = {(k if "/" in k else f"{role}/{k}"): v for k, v in result.metrics.items()}
    return metrics | {
        f"{role}/{mk.GRAD_NORM}": result.grad_norm,
        f"{role}/{mk.LR}": result.lr,
        f"{role}/{mk.SKIPPED_STEPS}": float(result.skipped),
    }


def _drain(stream) -> None:
    for _ in stream:
        pass
