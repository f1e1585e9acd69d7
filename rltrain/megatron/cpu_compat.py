"""Let megatron-core 0.16.1 run on a CPU-only torch build.

Contract: ``apply_cpu_compat()`` is idempotent, makes only the replacements marked ``without_te``
when CUDA is available but Transformer Engine does not import (Megatron's own code assumes TE on
CUDA there: ``NameError: name 'te_general_gemm' is not defined`` in every MoE router), nothing when
both are there, and otherwise the fewest replacements that let Megatron's tensor/pipeline/expert parallelism, distributed optimizer and
``dist_checkpointing`` run on gloo. Each replacement names the Megatron source line that fails
without it (``failing_source``, searched in ``evidence``); ``check_cpu_compat()`` verifies that every
target still exists and every failing line is still present in the installed megatron-core, so an
upgrade that changes them fails a test instead of silently running unpatched or over-patched code.

Measured failures and fixes: /work/shared/facts/megatron-core-on-cpu.md.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

MEGATRON_CORE_VERSION = "0.16.1"
"""The megatron-core release these replacements (and the rest of rltrain.megatron) were written for."""

_MARK = "_rltrain_cpu_compat"
_ORIGINAL = "_rltrain_original"
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange")


@dataclass(frozen=True)
class Replacement:
    """One attribute replaced on a CPU-only torch."""

    module: str
    """Module holding the attribute, e.g. ``megatron.core.tensor_parallel.random``."""
    attribute: str
    """Dotted attribute inside ``module`` (``Class.method`` allowed)."""
    evidence: str
    """``module:qualname`` of the Megatron code that fails without the replacement."""
    failing_source: str
    """A line of ``evidence``'s source that fails on CPU (checked to still exist)."""
    make: Callable[[Any], Any]
    """Builds the replacement from the original attribute."""
    without_te: bool = False
    """Needed wherever Transformer Engine does not import, on CUDA too (not only without CUDA)."""


def _marked(fn: Any) -> Any:
    setattr(fn, _MARK, True)
    return fn


class _CpuDeviceTorch:
    """Stands in for the name ``torch`` inside one Megatron module: tensor factories called with a
    ``"cuda"`` device allocate on the CPU instead; everything else is the real torch."""

    def __init__(self, real: Any) -> None:
        self._real = real
        setattr(self, _MARK, True)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        if name not in _FACTORIES:
            return value

        def factory(*args: Any, **kwargs: Any) -> Any:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs["device"] = "cpu"
                kwargs.pop("pin_memory", None)
            return value(*args, **kwargs)

        return factory


def _get_cpu_rng_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _tracker_add_cpu(self: Any, name: str, seed: int) -> None:
    """``CudaRNGStatesTracker.add`` keeping a CPU generator state per name."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise ValueError(f"RNG seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise ValueError(f"RNG state {name} already exists")
    orig = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig)


def _clip_grad_by_total_norm_cpu(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """``clip_grad_by_total_norm_fp32`` without its CUDA tensor-type assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


@contextlib.contextmanager
def _cpu_types_look_like_cuda() -> Iterator[None]:
    original = torch.Tensor.type

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if not args and not kwargs and isinstance(name, str) and name.startswith("torch."):
            return name.replace("torch.", "torch.cuda.", 1)
        return name

    torch.Tensor.type = type_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _build_groups_accepting_cpu(original: classmethod) -> classmethod:
    fn = original.__func__

    def build(cls: type, *args: Any, **kwargs: Any) -> Any:
        with _cpu_types_look_like_cuda():
            return fn(cls, *args, **kwargs)

    return classmethod(_marked(build))


def _set_states_present(original: Any) -> Any:
    def set_states(self: Any, model_param: Any, tensors: dict) -> None:
        """Copy only the states the checkpoint holds: torch's Adam keeps a per-parameter ``step``
        that ``load_state_dict`` already restored from the param groups."""
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        for key, dst in {"param": main_param, **self.optimizer.state[main_param]}.items():
            if key in tensors:
                dst.copy_(tensors[key])
        return None

    return _marked(set_states)


def _to_host(tensor: Any, as_numpy: bool = False) -> Any:
    # Megatron's maybe_move_tensor_to_cpu leaves CPU tensors as tensors even with as_numpy=True, and
    # all_to_all_single rejects tensors as split sizes (it takes the numpy arrays the GPU path makes).
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        return tensor.numpy() if as_numpy else tensor
    return tensor


def _dtoh_without_streams(self: Any, point: str, tokens_per_expert: Any = None) -> Any:
    """``_maybe_dtoh_and_synchronize`` of the all-to-all dispatcher without CUDA streams: the same
    host copies (split sizes as numpy) at the same point."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        tokens_per_expert = _to_host(tokens_per_expert)
        self.input_splits = _to_host(self.input_splits, as_numpy=True)
        self.output_splits = _to_host(self.output_splits, as_numpy=True)
        self.output_splits_tp = _to_host(self.output_splits_tp, as_numpy=True)
        self.num_out_tokens = _to_host(self.num_out_tokens)
        if self.num_local_experts > 1 and not self.config.moe_permute_fusion:
            self.num_global_tokens_per_local_expert = _to_host(self.num_global_tokens_per_local_expert)
    return tokens_per_expert


def _torch_proxy(module: str, evidence: str, failing_source: str) -> Replacement:
    return Replacement(module, "torch", evidence, failing_source, _CpuDeviceTorch)


_MC = "megatron.core"
REPLACEMENTS: tuple[Replacement, ...] = (
    # model_parallel_cuda_manual_seed -> tracker.add:
    #   AssertionError: Torch not compiled with CUDA enabled
    Replacement(
        f"{_MC}.tensor_parallel.random",
        "CudaRNGStatesTracker.add",
        f"{_MC}.tensor_parallel.random:CudaRNGStatesTracker.add",
        "orig_rng_state = torch.cuda.get_rng_state()",
        lambda _orig: _marked(_tracker_add_cpu),
    ),
    # tracker.fork() and activation recomputation (CheckpointFunction) read/write the CUDA
    # generator: AssertionError: Torch not compiled with CUDA enabled
    Replacement(
        f"{_MC}.tensor_parallel.random",
        "_get_cuda_rng_state",
        f"{_MC}.tensor_parallel.random:_get_cuda_rng_state",
        "return torch.cuda.random.get_rng_state(device=device)",
        lambda _orig: _marked(_get_cpu_rng_state),
    ),
    Replacement(
        f"{_MC}.tensor_parallel.random",
        "_set_cuda_rng_state",
        f"{_MC}.tensor_parallel.random:_set_cuda_rng_state",
        "default_generator = torch.cuda.default_generators[idx]",
        lambda _orig: _marked(_set_cpu_rng_state),
    ),
    # ~175 call sites, e.g. GlobalMemoryBuffer.get_tensor (local attention scores):
    #   AssertionError: Torch not compiled with CUDA enabled
    Replacement(
        "torch.cuda",
        "current_device",
        f"{_MC}.utils:GlobalMemoryBuffer.get_tensor",
        "device=torch.cuda.current_device()",
        lambda _orig: _marked(lambda: torch.device("cpu")),
    ),
    # p2p_communication with batch_p2p_sync=True and the dist_checkpointing async writer:
    #   AssertionError: Torch not compiled with CUDA enabled
    Replacement(
        "torch.cuda",
        "synchronize",
        f"{_MC}.pipeline_parallel.p2p_communication:P2PCommunicator._communicate",
        "torch.cuda.synchronize()",
        lambda _orig: _marked(lambda device=None: None),
    ),
    # LanguageModule.setup_embeddings_and_output_layer (tied embeddings, PP>1), optimizer state
    # loading and dist_checkpointing exchange: AssertionError: Torch not compiled with CUDA enabled
    Replacement(
        "torch",
        "Tensor.cuda",
        f"{_MC}.models.common.language_module.language_module:LanguageModule.setup_embeddings_and_output_layer",
        "weight.data = weight.data.cuda()",
        lambda _orig: _marked(lambda self, *args, **kwargs: self),
    ),
    # Hard-coded device="cuda" tensors: AssertionError: Torch not compiled with CUDA enabled
    _torch_proxy(f"{_MC}.transformer.utils", f"{_MC}.transformer.utils", 'device="cuda"'),
    _torch_proxy(f"{_MC}.optimizer.optimizer", f"{_MC}.optimizer.optimizer", "device='cuda'"),
    _torch_proxy(f"{_MC}.optimizer.clip_grads", f"{_MC}.optimizer.clip_grads", "device='cuda'"),
    _torch_proxy(f"{_MC}.utils", f"{_MC}.utils", 'device="cuda"'),
    _torch_proxy(f"{_MC}.pipeline_parallel.schedules", f"{_MC}.pipeline_parallel.schedules", 'device="cuda"'),
    _torch_proxy(f"{_MC}.transformer.moe.moe_utils", f"{_MC}.transformer.moe.moe_utils", 'device="cuda"'),
    # optimizer.step() -> clip_grad_by_total_norm_fp32: bare AssertionError on
    #   assert param.grad.type() == 'torch.cuda.FloatTensor'
    Replacement(
        f"{_MC}.optimizer.optimizer",
        "clip_grad_by_total_norm_fp32",
        f"{_MC}.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
        "assert param.grad.type() == 'torch.cuda.FloatTensor'",
        lambda _orig: _marked(_clip_grad_by_total_norm_cpu),
    ),
    # DistributedOptimizer.__init__: TypeError: Wrapped parameters must be one of
    #   torch.cuda.FloatTensor, ... Received torch.FloatTensor
    Replacement(
        f"{_MC}.optimizer.distrib_optimizer",
        "DistributedOptimizer._build_model_and_main_param_groups",
        f"{_MC}.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups",
        "elif model_param.type() == 'torch.cuda.FloatTensor':",
        _build_groups_accepting_cpu,
    ),
    # Loading a fully_reshardable distributed-optimizer checkpoint with torch's Adam (no Apex/TE):
    #   KeyError: 'step'  (the checkpoint skips Adam's per-parameter step; the copy loop expects it)
    Replacement(
        f"{_MC}.optimizer.distrib_optimizer",
        "DistributedOptimizer._set_main_param_and_optimizer_states",
        f"{_MC}.optimizer.distrib_optimizer:DistributedOptimizer._set_main_param_and_optimizer_states",
        "dst_tensors[key].copy_(tensors[key])",
        _set_states_present,
    ),
    # MoE router without Transformer Engine: NameError: name 'te_general_gemm' is not defined
    Replacement(
        f"{_MC}.transformer.moe.moe_utils",
        "te_general_gemm",
        f"{_MC}.transformer.moe.moe_utils:RouterGatingLinearFunction.forward",
        "if te_general_gemm is not None",
        lambda _orig: None,
        without_te=True,
    ),
    # MLA without Transformer Engine: megatron.core.extensions.transformer_engine defines its TE
    # classes over a MagicMock, so MLA's HAVE_TE is True and its TELinear check fails:
    #   TypeError: isinstance() arg 2 must be a type, a tuple of types, or a union
    #   when instantiating MLASelfAttention
    Replacement(
        f"{_MC}.transformer.multi_latent_attention",
        "HAVE_TE",
        f"{_MC}.transformer.multi_latent_attention:MultiLatentAttention.__init__",
        "and isinstance(self.linear_proj, TELinear)",
        lambda _orig: False,
        without_te=True,
    ),
    # MoEAlltoAllTokenDispatcher: RuntimeError: torch.cuda.Stream requires CUDA support
    Replacement(
        f"{_MC}.transformer.moe.token_dispatcher",
        "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
        f"{_MC}.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
        "with torch.cuda.stream(self.cuda_dtoh_stream):",
        lambda _orig: _marked(_dtoh_without_streams),
    ),
    Replacement(
        f"{_MC}.transformer.moe.token_dispatcher",
        "MoEAlltoAllTokenDispatcher.cuda_dtoh_stream",
        f"{_MC}.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher.__init__",
        "MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()",
        lambda _orig: "unused-on-cpu",
    ),
)


def _resolve(dotted: str, attribute: str) -> tuple[Any, str]:
    """Return (owner object, last attribute name) for ``dotted`` module and ``attribute`` path."""
    owner: Any = importlib.import_module(dotted)
    *parents, last = attribute.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, last


def _evidence_source(evidence: str) -> str:
    module_name, _, qualname = evidence.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = inspect.getattr_static(obj, part)
        obj = obj.__func__ if isinstance(obj, staticmethod | classmethod) else obj
        obj = getattr(obj, _ORIGINAL, obj)
    return inspect.getsource(obj)


def check_cpu_compat() -> list[str]:
    """Problems that make a replacement stale for the installed megatron-core (empty when all match).

    Reads sources only; works before or after ``apply_cpu_compat``.
    """
    from megatron.core.package_info import __version__ as installed

    problems = []
    if installed != MEGATRON_CORE_VERSION:
        problems.append(
            f"megatron-core {installed} is installed; rltrain.megatron pins {MEGATRON_CORE_VERSION}"
        )
    for rep in REPLACEMENTS:
        try:
            owner, name = _resolve(rep.module, rep.attribute)
        except (ImportError, AttributeError) as err:
            problems.append(f"{rep.module}.{rep.attribute}: target missing ({err})")
            continue
        if rep.attribute != "te_general_gemm" and not hasattr(owner, name):
            problems.append(f"{rep.module}.{rep.attribute}: attribute missing")
        try:
            source = _evidence_source(rep.evidence)
        except (ImportError, AttributeError, TypeError, OSError) as err:
            problems.append(f"{rep.evidence}: evidence missing ({err})")
            continue
        if rep.failing_source not in source:
            problems.append(f"{rep.evidence}: no longer contains {rep.failing_source!r}")
    return problems


def cpu_compat_needed() -> bool:
    return not torch.cuda.is_available()


@functools.cache
def transformer_engine_problem() -> str | None:
    """Why Transformer Engine cannot be used in this process (its import error), None where it can."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def apply_cpu_compat() -> bool:
    """Apply every replacement once when CUDA is absent, and those marked ``without_te`` on CUDA
    without Transformer Engine; returns whether the CPU replacements are in effect."""
    if cpu_compat_needed():
        needed = REPLACEMENTS
    elif transformer_engine_problem() is not None:
        needed = [rep for rep in REPLACEMENTS if rep.without_te]
    else:
        return False
    for rep in needed:
        owner, name = _resolve(rep.module, rep.attribute)
        current = inspect.getattr_static(owner, name, None)
        inner = current.__func__ if isinstance(current, staticmethod | classmethod) else current
        if getattr(inner, _MARK, False) or (rep.attribute == "te_general_gemm" and hasattr(owner, name)):
            continue
        if rep.attribute.endswith("cuda_dtoh_stream") and current is not None:
            continue
        replacement = rep.make(current)
        target = replacement.__func__ if isinstance(replacement, staticmethod | classmethod) else replacement
        if callable(target) and callable(inner):
            setattr(target, _ORIGINAL, inner)
        setattr(owner, name, replacement)
    return needed is REPLACEMENTS
