"""The in-place reload every non-direct weight load goes through, and what vLLM's reload leaves undone.

vLLM's ``reload_weights(..., is_checkpoint_format=True)`` (its layerwise reload) moves every layer to
the meta device, counts the elements each parameter's ``weight_loader`` takes, and rebuilds a layer
once its count is full. A layer with nothing counted gets its old tensors back with one log line
("<Layer>: Failed to load weights"), so a model whose ``load_weights`` writes some parameters by plain
``copy_`` (bypassing ``weight_loader``) silently keeps stale values there, on every platform.

Contract of :func:`reload_in_place` (the in-process engine and each worker of a multi-process one):
- HF tensors that :data:`COPY_LOADED` names for the model's class are held back; the rest go through
  ``reload`` (the worker's ``reload_weights``) and ``worker_fns.finish_reload`` as before.
- After the reload returns (the layers are real again) the held-back tensors go straight into
  ``model.load_weights``. Each fused-MoE module they touch is first given fresh model-format
  ``w13_weight``/``w2_weight`` (the shapes vLLM recorded before its kernel processing), then gets
  vLLM's own post-load processing (plus the CPU prepack, ``worker_fns.prepack_cpu_experts``), and the
  result is copied into the kernel tensors it had (same objects and storage: kernels and CUDA graphs
  keep their references). Biases and attention sinks are copied in place by the model's loader.
- A reload that leaves a layer stale anyway (the model reports one of its parameters loaded, vLLM
  counted none) raises ``RuntimeError`` naming the layer and the model class, after vLLM has put the
  old tensors back (the engine stays whole, serving the old weights).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from megatron_bridge.vllm_names import fused_group
from rltrain.weight_sync.types import NamedTensor


@dataclass(frozen=True)
class CopyLoaded:
    """HF tensors that one vLLM model class's ``load_weights`` writes by plain copy."""

    suffixes: tuple[str, ...]
    """HF names ending in one of these are held back from the reload."""
    clobbered: tuple[str, ...]
    """Of those, the ones whose loader writes into the tensor it is given (passed a private copy)."""
    why: str


COPY_LOADED: dict[str, CopyLoaded] = {
    "GptOssForCausalLM": CopyLoaded(
        suffixes=(
            ".mlp.experts.gate_up_proj",
            ".mlp.experts.gate_up_proj_bias",
            ".mlp.experts.down_proj",
            ".mlp.experts.down_proj_bias",
            ".self_attn.sinks",
        ),
        clobbered=(".mlp.experts.down_proj_bias",),
        why=(
            "vLLM 0.32's _load_weights_other copies the stacked (unquantized) experts, their biases and "
            "the attention sinks with param.copy_; it zeroes down_proj_bias in place on TP ranks but 0"
        ),
    ),
}
"""vLLM model class name → the HF tensors its ``load_weights`` copies in without ``weight_loader``."""


def copy_loaded_of(model: torch.nn.Module) -> CopyLoaded | None:
    """The :data:`COPY_LOADED` entry of ``model``'s class, or None."""
    return COPY_LOADED.get(type(model).__name__)


def reload_in_place(
    model: torch.nn.Module,
    tensors: Iterable[NamedTensor],
    *,
    reload: Callable[[Iterable[NamedTensor]], object],
    table: dict[str, CopyLoaded] = COPY_LOADED,
) -> list[str]:
    """Load ``tensors`` (HF names; a stream is consumed once) into ``model``: ``reload`` (the worker's
    ``reload_weights``) for all but the copy-loaded ones, which follow it (see the module docstring).
    Returns the HF names loaded. ``table`` is :data:`COPY_LOADED` (tests pass others)."""
    from rltrain.rollout.vllm.worker_fns import finish_reload

    entry = table.get(type(model).__name__)
    names: list[str] = []
    held: list[NamedTensor] = []

    def reloaded() -> Iterator[NamedTensor]:
        for name, tensor in tensors:
            names.append(name)
            if entry is not None and name.endswith(entry.suffixes):
                held.append((name, tensor.clone() if name.endswith(entry.clobbered) else tensor))
            else:
                yield name, tensor

    with stale_layer_check(model):
        reload(reloaded())
    held_names = {name for name, _ in held}
    finish_reload(model, [name for name in names if name not in held_names])
    if held:
        load_copy_loaded(model, held)
    return names


def load_copy_loaded(model: torch.nn.Module, tensors: list[NamedTensor]) -> None:
    """Load copy-loaded HF ``tensors`` with ``model.load_weights`` outside a reload (see the module
    docstring); every fused-MoE module they touch ends processed once, after its load."""
    from rltrain.rollout.vllm.worker_fns import fused_moe_modules, prepack_cpu_experts

    groups = sorted({fused_group(name) for name, _ in tensors if ".experts." in name})
    modules = [(g, m) for g in groups for m in fused_moe_modules(model, g)]
    kernel = {id(m): _swap_in_model_format(g, m) for g, m in modules}
    model.load_weights(tensors)
    for group, module in modules:
        module.quant_method.process_weights_after_loading(module)
        prepack_cpu_experts(module, group)
        _copy_into_kernel_tensors(group, module, kernel[id(module)])


_EXPERT_WEIGHTS = ("w13_weight", "w2_weight")


def _swap_in_model_format(group: str, module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Give ``module`` fresh expert weights of the model-format shape vLLM recorded before processing
    (``[experts, 2 * intermediate, hidden]``, ``[experts, hidden, intermediate]``); returns the kernel
    parameters they replace."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    recorded = get_layerwise_info(module).restore_metadata[0]
    kernel = {}
    for name in _EXPERT_WEIGHTS:
        meta = recorded.get(name)
        if meta is None:
            raise RuntimeError(f"fused-MoE module under {group!r}: no recorded model-format shape of {name}")
        kernel[name] = module._parameters[name]
        fresh = torch.nn.Parameter(
            torch.empty(meta.shape, dtype=meta.dtype, device=kernel[name].device), requires_grad=False
        )
        fresh.__dict__.update(kernel[name].__dict__)  # weight_loader and the other loading attributes
        module._parameters[name] = fresh
    return kernel


def _copy_into_kernel_tensors(
    group: str, module: torch.nn.Module, kernel: dict[str, torch.nn.Parameter]
) -> None:
    """Copy ``module``'s processed expert weights into its ``kernel`` parameters and put those back."""
    for name, param in kernel.items():
        processed = module._parameters[name]
        if processed.shape != param.shape or processed.dtype != param.dtype:
            raise RuntimeError(
                f"fused-MoE module under {group!r}: processed {name} is {tuple(processed.shape)} "
                f"{processed.dtype}, its kernel tensor {tuple(param.shape)} {param.dtype}"
            )
        with torch.no_grad():
            param.copy_(processed)
        module._parameters[name] = param


def stale_layers(model: torch.nn.Module, loaded: set[str]) -> list[str]:
    """Layers of ``model`` (during a layerwise reload) that ``load_weights`` reported loading
    (``loaded``: vLLM parameter names) but whose wrapped loaders took no element: vLLM will put their
    old tensors back. As ``"<class> <module name>"``."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    stale = []
    for module_name, module in model.named_modules():
        info = LAYERWISE_INFO.get(module)
        if info is None or not info.can_load() or info.load_numel > 0:
            continue
        own = {f"{module_name}.{p}" if module_name else p for p, _ in module.named_parameters(recurse=False)}
        if own & loaded:
            stale.append(f"{type(module).__name__} {module_name}")
    return stale


@contextmanager
def stale_layer_check(model: torch.nn.Module) -> Iterator[None]:
    """Around a ``reload_weights`` of ``model``: raise ``RuntimeError`` after it if it left a layer
    stale (:func:`stale_layers`, checked when the model's ``load_weights`` returns, before vLLM's
    finalize puts the old tensors back)."""
    original = model.load_weights
    found: list[str] = []

    def checked(weights: Iterable[NamedTensor]) -> set[str]:
        loaded = original(weights)
        found.extend(stale_layers(model, set(loaded or ())))
        return loaded

    model.load_weights = checked
    try:
        yield
    finally:
        del model.load_weights
    if found:
        raise RuntimeError(
            f"{type(model).__name__}: vLLM's reload_weights left {len(found)} layer(s) with their old "
            f"weights (the model's load_weights bypassed their weight_loader), first {found[0]!r}; "
            "name its tensors in rltrain.rollout.vllm.reload.COPY_LOADED"
        )
