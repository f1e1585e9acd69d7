"""The rollout engine of a rank: its settings from the config, building it (the backend that
``rollout.name`` names, offline or asynchronous), running a batch through it (directly, or through
the agent loop for multi-turn), and ``RolloutWorker``, the rank of an engine on devices of its own
(``rollout.mode: separate``), which takes the actor's weights from the trainer ranks that own them. The engine is used
through ``rltrain.rollout.protocol`` only; its backend is imported lazily, so that the driver never
loads it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from rltrain.config import RLConfig
from rltrain.logging import metrics as mk

if TYPE_CHECKING:
    from rltrain.rollout.protocol import EngineSettings, RolloutEngine

from rltrain.weight_sync.verify import EngineCheck
from rltrain.workers.rank_base import RankInfo, params_dtype_of

log = logging.getLogger(__name__)


def engine_settings(config: RLConfig) -> EngineSettings:
    """The engine settings of ``config``: ``rollout``'s (with the options of the backend ``rollout.name``
    names), the context length from the data if unset, the model's dtype, and the routed experts
    asked for under ``actor.router_replay.mode=R3``."""
    from rltrain.rollout.registry import get_backend

    max_len = config.rollout.max_model_len or config.data.max_prompt_length + config.rollout.response_length
    return replace(
        get_backend(config.rollout.name).settings(config.rollout),
        max_model_len=max_len,
        dtype=config.model.dtype,
        return_routed_experts=config.actor.router_replay.mode == "R3",
    )


def build_engine(config: RLConfig, model_dir: str) -> RolloutEngine:
    """The engine of ``config.rollout`` for ``model_dir``, built by the backend ``rollout.name`` names:
    asynchronous where ``rollout.uses_async_engine()`` (with ``rollout.partial_rollout``), else
    offline, with :func:`engine_settings`."""
    from rltrain.rollout.registry import get_backend

    return get_backend(config.rollout.name).build(
        model_dir,
        engine_settings(config),
        asynchronous=config.rollout.uses_async_engine(),
        partial_rollout=config.rollout.partial_rollout,
    )


class RolloutWorker:
    """A rollout engine on its own devices (``rollout.mode: separate``); weights arrive from the
    trainer ranks (``connect_weight_sync``)."""

    def __init__(self, config: RLConfig, model_dir: str, info: RankInfo) -> None:
        self.config = config
        self.rank = info.rank
        self.engine = build_engine(config, model_dir)
        self.receiver: Any = None
        """This engine's end of the weights' group (``rltrain.weight_sync.shard_to_shard`` or
        ``broadcast``)."""
        sync = config.rollout.weight_sync
        self.check = EngineCheck(
            verify=sync.verify_checksums,
            every=sync.verify_every,
            dtype=params_dtype_of(config.model.dtype),
            where=f"separate engine {self.rank}",
        )
        """This engine's verification after each sync (``rltrain.weight_sync.verify``)."""
        self.batches: Any = None
        """The pipeline's queued batches with ``rollout.partial_rollout`` (built at the first)."""

    def connect_weight_sync(self, address: tuple[str, int], num_engines: int, num_senders: int) -> None:
        """Join the weights' group at ``address`` after its ``num_senders`` trainer ranks (all of
        them: ``shard_to_shard``; rank 0: ``broadcast``, ``rltrain.weight_sync.transport``)."""
        from rltrain.weight_sync.broadcast import BroadcastTransport, join_broadcast_group
        from rltrain.weight_sync.shard_to_shard import ShardToShardReceiver

        group, device = join_broadcast_group(
            address,
            group_rank=num_senders + self.rank,
            world_size=num_senders + num_engines,
            timeout_s=self.config.trainer.timeouts.collective_s,
        )
        bucket_bytes = self.config.rollout.weight_sync.bucket_size_mb << 20
        if self.config.rollout.weight_sync.transport == "broadcast":
            self.receiver = BroadcastTransport(
                group=group, src_rank=0, bucket_bytes=bucket_bytes, device=device
            )
        else:
            self.receiver = ShardToShardReceiver(group=group, bucket_bytes=bucket_bytes, device=device)

    def receive_weights(self, step: int | None = None, version: int | None = None) -> dict[str, float]:
        """Load the trainer's weights as they arrive, then check them (``rollout.weight_sync.
        verify_checksums``: what this engine was handed, digested on its way in, against what its
        workers read back; ``step`` numbers the sync, as on the trainer's side, and the first is
        checked whole). A mismatch raises :class:`~rltrain.errors.WeightSyncMismatchError` naming
        the tensor, the engine rank and the trainer rank that sent it. ``version`` (the pipeline
        with ``rollout.partial_rollout``): the policy version they are, loaded through the
        asynchronous engine's ``weight_update`` so that batches in flight pause (or finish) around
        the load and label their tokens; equal to the engine's version (the run's first send) it
        is a plain load, nothing being in flight."""
        from rltrain.errors import WeightSyncMismatchError
        from rltrain.rollout.partial import load_as_version
        from rltrain.weight_sync.verify import TappedEngine

        digester = self.check.digester(step)
        tapped = TappedEngine(self.engine, digester)
        stats = load_as_version(self.engine, version, lambda: self.receiver.receive(tapped))
        metrics = {
            mk.WEIGHT_SYNC_RECEIVE_SECONDS: stats.seconds,
            mk.WEIGHT_SYNC_BUCKETS: float(stats.num_buckets),
        }
        if digester is not None:
            started = time.perf_counter()
            problems, num_verified = self.check.compare(self.engine, digester)
            self.check.num_syncs += 1
            if problems:
                more = f" (and {len(problems) - 1} more mismatches)" if len(problems) > 1 else ""
                raise WeightSyncMismatchError(problems[0] + more)
            metrics[mk.WEIGHT_SYNC_CHECKSUM_MISMATCHES] = 0.0
            metrics[mk.WEIGHT_SYNC_VERIFY_SECONDS] = time.perf_counter() - started
            metrics[mk.WEIGHT_SYNC_VERIFIED_TENSORS] = float(num_verified)
        return metrics

    def generate(self, prompts: list[list[int]], sampling) -> Any:
        return run_engine(self.engine, self.config, prompts, sampling) if prompts else None

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


def run_engine(engine, config: RLConfig, prompts: list, sampling) -> Any:
    """Wake the engine, sample (token-id prompts), or run the agent loop (``AgentPrompt``s, with
    ``rollout.multi_turn.enable``), and (``rollout.free_cache_engine``) put it back to sleep."""
    engine.wake_up()
    if config.rollout.multi_turn.enable:
        output = agent_loop(engine, config).generate(prompts, sampling)
    else:
        output = engine.generate(prompts, sampling)
    if config.rollout.free_cache_engine:
        engine.sleep()
    return output


def agent_loop(engine, config: RLConfig):
    """The engine's agent loop (its tools and interaction), built at the first multi-turn rollout."""
    loop = getattr(engine, "agent_loop", None)
    if loop is None:
        from rltrain.agent.loop import AgentLoop

        loop = engine.agent_loop = AgentLoop.from_config(engine, config.rollout.multi_turn)
    return loop
