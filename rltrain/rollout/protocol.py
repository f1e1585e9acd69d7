"""The rollout engine protocol: what the trainer, the weight sync, the agent loop and the
partial-rollout queue use of an engine, and the settings every backend takes.

A backend (one folder under ``rltrain/rollout/``, registered in ``rltrain.rollout.registry``) builds
engines that satisfy ``RolloutEngine``, and ``AsyncRolloutEngine`` where it serves requests one by
one (multi-turn agent loops, partial rollouts). Callers use nothing else of an engine:
- generation: ``generate`` (a batch of prompts, token ids or chat messages) returning a
  ``RolloutOutput``, with the experts its MoE routers chose per token (routing replay) where
  ``EngineSettings.return_routed_experts`` asks for them; ``tokenizer`` for the agent's chat glue;
- weight receive: ``receive`` (per HF tensor the regions each of its ``num_workers`` workers reads,
  loaded in place; every transport of ``rltrain.weight_sync`` ends in it) and ``load_weights``
  (whole tensors); both reset the prefix cache;
- checksums: ``all_weights_digests`` (per worker ``{hf_name: sha256}`` of the effective weights)
  and ``weights_digests`` (worker 0's), compared with the trainer's by ``rltrain.weight_sync``;
- memory: ``sleep`` / ``wake_up`` release and restore weights and KV cache between rollouts (a
  backend that cannot says so once and returns; ``asleep`` tells), ``reset_prefix_cache``;
  ``shutdown``.
The asynchronous engine adds ``loop`` / ``run`` (its event loop, and running a coroutine on it from
sync code), ``agenerate`` / ``agenerate_versioned`` (one request on that loop), ``start_batch`` (a
batch whose weights may change while it generates) and ``weight_update`` (a load while requests
are in flight, labelled ``policy_version``).

Pure module: no backend is imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from rltrain.rollout.types import RolloutOutput, Sample, SamplingConfig

if TYPE_CHECKING:
    import asyncio

    from rltrain.rollout.partial import RolloutBatch, VersionedSample
    from rltrain.weight_sync.sampling import DigestRequest
    from rltrain.weight_sync.types import NamedTensor, SyncStats, TensorRegions

T = TypeVar("T")

Prompt = list[int] | list[dict[str, str]]
"""Token ids, or a chat conversation ``[{"role": ..., "content": ...}, ...]``."""


@dataclass(frozen=True)
class EngineSettings:
    """How one rollout engine is started (everything except the model path). The fields are what
    any backend has (verl's rollout vocabulary); what only one backend knows is in ``options``."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size of the engine (its number of worker ranks)."""

    gpu_memory_utilization: float = 0.5
    """Fraction of device memory for weights + KV cache (a CPU engine sizes its cache otherwise)."""

    max_num_batched_tokens: int | None = None
    """Token budget of one scheduler step; None keeps the backend's default."""

    max_num_seqs: int | None = None
    """Sequences scheduled at once; None keeps the backend's default."""

    max_model_len: int | None = None
    """Context length of the engine; None takes the model config's."""

    enforce_eager: bool = True
    """Disable CUDA graphs / compilation (always eager on CPU)."""

    enable_prefix_caching: bool = True
    """Reuse KV cache across common prompt prefixes; reset after every weight load."""

    enable_sleep_mode: bool = False
    """Allow ``sleep``/``wake_up`` to release weights and KV cache between rollouts (GPU only)."""

    dtype: str = "auto"
    """Weight/compute dtype; ``auto`` means float32 on CPU (no fast bf16 there) and bfloat16 on GPU."""

    seed: int = 0
    """Engine seed."""

    return_routed_experts: bool = False
    """Have the engine return the experts its MoE routers chose for every token
    (``Sample.routed_experts``), for rollout routing replay (``actor.router_replay.mode=R3``)."""

    options: Any = None
    """The backend's own options (the vLLM backend's ``rltrain.rollout.vllm.options.VllmOptions``);
    None: the backend's defaults."""

    @classmethod
    def from_rollout_config(cls, cfg: Any, *, options: Any = None) -> EngineSettings:
        """Settings from ``rltrain.config.rollout.RolloutConfig`` (read by attribute, no import);
        ``options``: the backend's, from the same config (``EngineBackend.options_from_config``)."""
        return cls(
            tensor_model_parallel_size=cfg.tensor_model_parallel_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=cfg.max_model_len,
            enforce_eager=cfg.enforce_eager,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enable_sleep_mode=cfg.free_cache_engine,
            seed=cfg.seed,
            options=options,
        )


class RolloutEngine(Protocol):
    """A rollout engine driven from this process: batch generation, weight receive, checksums,
    sleep/wake and prefix-cache reset."""

    settings: EngineSettings
    tokenizer: Any
    """The model's tokenizer (HF interface: ``apply_chat_template``, ``encode``, ``decode``)."""

    @property
    def num_workers(self) -> int:
        """The engine's TP workers (what ``TensorRegions.regions`` is keyed by)."""
        ...

    def generate(self, prompts: list[Prompt], sampling: SamplingConfig) -> RolloutOutput:
        """``sampling.n`` samples per prompt with the log-probability of every sampled token."""
        ...

    def receive(self, updates: Iterable[TensorRegions], *, bucket_bytes: int = ...) -> SyncStats:
        """Load HF tensors in place, each worker its own regions (every fused module a call
        touches complete in it), then reset the prefix cache."""
        ...

    def load_weights(self, named_tensors: Iterable[NamedTensor], *, bucket_bytes: int = ...) -> SyncStats:
        """``receive`` of whole HF tensors."""
        ...

    def weights_digests(self) -> dict[str, str]:
        """``{hf_name: sha256}`` of the effective weights of worker 0's shard."""
        ...

    def all_weights_digests(self, request: DigestRequest | None = None) -> list[dict[str, str]]:
        """Per worker (TP rank order): ``{hf_name: sha256}`` of the effective weights of its shard;
        with a ``request`` (``rltrain.weight_sync.sampling``), only the tensors it names, each on
        its requested columns."""
        ...

    @property
    def asleep(self) -> bool:
        """Whether ``sleep`` released memory that ``wake_up`` has not restored yet."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache (level 1: offload weights to host; level 2: drop them too)."""
        ...

    def wake_up(self) -> None:
        """Restore what ``sleep`` released."""
        ...

    def reset_prefix_cache(self) -> None: ...

    def shutdown(self) -> None:
        """Stop the engine (unusable afterwards)."""
        ...


class AsyncRolloutEngine(RolloutEngine, Protocol):
    """A rollout engine that serves requests one by one on an event loop of its own."""

    loop: asyncio.AbstractEventLoop
    """The engine's event loop: ``agenerate`` runs there (the agent loop's coroutines too)."""

    partial_rollout: bool
    """What ``weight_update`` does with requests in flight (``rollout.partial_rollout``)."""

    policy_version: int
    """The version of the weights serving now (0 at start); ``weight_update`` sets it."""

    def run(self, coro: Coroutine[Any, Any, T], *, timeout_s: float | None = None, what: str = ...) -> T:
        """Run ``coro`` on ``loop`` from sync code; a timeout or a dead engine raises naming ``what``."""
        ...

    async def agenerate(
        self, prompt_ids: list[int], sampling: SamplingConfig, *, request_id: str
    ) -> list[Sample]:
        """One request's ``sampling.n`` samples, in index order; call on ``loop``."""
        ...

    async def agenerate_versioned(
        self, prompt_ids: list[int], sampling: SamplingConfig, *, request_id: str
    ) -> list[VersionedSample]:
        """``agenerate`` with the policy version of every token."""
        ...

    def start_batch(self, prompts: list[Prompt], sampling: SamplingConfig) -> RolloutBatch:
        """Send one request per prompt (from sync code) and return once they are sent."""
        ...

    def weight_update(
        self, *, version: int, timeout_s: float = ...
    ) -> contextlib.AbstractContextManager[None]:
        """A block in which ``receive`` / ``load_weights`` run while requests may be in flight; on
        exit the new weights serve as ``version``."""
        ...
