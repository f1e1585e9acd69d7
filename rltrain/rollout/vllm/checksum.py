"""Weight verification: digests of the engine's *effective* weights, mapped back to HF names.

What is compared, and why it is real:
- vLLM fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``, pads vocab rows, and on the
  CPU build hands every linear weight to a prepacked oneDNN / SGL kernel and leaves the parameter
  empty (``torch.Size([0])``). Reading ``named_parameters()`` therefore proves nothing there.
- ``engine_hf_weights`` reads back what the kernels actually multiply with: for a linear layer whose
  parameter is empty it runs the layer's own GEMM on an identity matrix (``x @ Wᵀ`` with ``x = I``
  gives ``Wᵀ`` exactly: every output element is one product with 1.0 plus exact zeros). Fused
  weights are split back by the layer's ``output_partition_sizes`` into the HF names of the model's
  ``packed_modules_mapping``; padded vocab rows are dropped. An LM head is read through its own
  kernel too: tied to the embedding, it still keeps a separate packed copy for the logits.
- ``tensor_digest`` (``rltrain.weight_sync.checksum``) is a SHA-256 of the bytes after casting to the engine dtype (what vLLM's loader
  does with ``copy_``), so equality means bit-identical weights in the engine.
The readback runs where the model lives (in-process, or inside each worker via ``collective_rpc``)
and covers the worker's own shard; the trainer side (``rltrain.weight_sync.sender``) digests the
same shard of the tensors it sent.
Dense decoders are covered, and the stacked experts of the models in ``STACKED_EXPERTS`` (GPT-OSS):
on CPU their prepacked ``w13_weight``/``w2_weight`` are read back in model format by inverting the
prepack, which is a permutation of the elements (found by prepacking the element indices; checked to
be one), then laid out as the HF tensors are. ``HF_RENAMES`` undoes the renames of such a model's
``hf_to_vllm_mapper`` (GPT-OSS's ``self_attn``/``attn``, ``embed_tokens``/``embedding``). Any other
fused-MoE module raises, naming it.
A ``DigestRequest`` (``rltrain.weight_sync.sampling``; the default, sampled verification) limits the
readback to the tensors it names and, for sampled ones, to a few columns of the last dimension: a
prepacked linear layer then multiplies only the selected rows of the identity (``I[cols] @ Wᵀ`` is
``W[:, cols]ᵀ``, exactly), once per fused module (its parts share the columns); other tensors are
indexed. With ``skip_unsupported`` a fused-MoE module that cannot be read back is skipped (said
once in this process's log) instead of raising.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator

import torch

from rltrain.weight_sync.checksum import tensor_digest
from rltrain.weight_sync.sampling import DigestRequest, take_columns
from rltrain.weight_sync.types import NamedTensor

log = logging.getLogger(__name__)


def _identity_rows(size: int, columns: list[int] | None, like: torch.Tensor) -> torch.Tensor:
    """The rows ``columns`` of the ``size``-square identity (all of it for None): a GEMM ``x @ Wᵀ``
    with them gives exactly those columns of ``W``, transposed."""
    if columns is None:
        return torch.eye(size, dtype=like.dtype, device=like.device)
    rows = torch.zeros(len(columns), size, dtype=like.dtype, device=like.device)
    rows[torch.arange(len(columns)), torch.tensor(columns)] = 1.0
    return rows


def _linear_weight(module: torch.nn.Module, columns: list[int] | None = None) -> torch.Tensor:
    """The [out, in] weight a (possibly prepacked) linear layer computes with (its ``columns`` only:
    [out, len(columns)])."""
    weight = module.weight
    if weight.numel() > 0:
        return take_columns(weight.detach(), columns)
    cpu_linear = getattr(module, "cpu_linear", None)
    if cpu_linear is None:
        raise RuntimeError(f"{type(module).__name__}: empty weight and no cpu_linear kernel to read back")
    # a replicated layer (a MoE router's GateLinear) has no per-partition size: its input is whole
    size = getattr(module, "input_size_per_partition", None) or module.input_size
    with torch.inference_mode():
        return cpu_linear(_identity_rows(size, columns, weight), None, None).t().contiguous()


def _vocab_weight(module: torch.nn.Module, columns: list[int] | None = None) -> torch.Tensor:
    """An embedding's weight (its ``columns`` only); for an LM head with a CPU kernel, the packed copy
    its logits GEMM uses (a tied head keeps its own copy of the embedding; reading the shared
    parameter would miss a stale copy)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    weight = module.weight.detach()
    cpu_linear = getattr(module, "cpu_linear", None)
    if not isinstance(module, ParallelLMHead) or cpu_linear is None:
        return take_columns(weight, columns)
    with torch.inference_mode():
        return cpu_linear(_identity_rows(weight.shape[1], columns, weight), weight, None).t().contiguous()


STACKED_EXPERTS: dict[str, dict[str, tuple[str, bool]]] = {
    "GptOssForCausalLM": {
        "w13_weight": ("gate_up_proj", True),  # HF [experts, hidden, 2 * intermediate], interleaved
        "w2_weight": ("down_proj", True),  # HF [experts, intermediate, hidden]
        "w13_bias": ("gate_up_proj_bias", False),
        "w2_bias": ("down_proj_bias", False),
    },
}
"""vLLM model class → fused-MoE parameter → (HF tensor beside ``experts``, transposed in the last two
dimensions): the models whose HF checkpoint stacks all experts of a layer in one tensor."""

HF_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "GptOssForCausalLM": ((".attn.", ".self_attn."), ("model.embedding.", "model.embed_tokens.")),
}
"""vLLM model class → (vLLM name part, HF name part) for the module names its mapper renames."""


def _model_format(weight: torch.Tensor, fused_experts: object) -> torch.Tensor:
    """A CPU-prepacked expert weight in model format: the prepack moves elements only, so prepacking
    the element indices (in base-256 digits, exact in any float dtype) gives where each one went."""
    from vllm import _custom_ops as ops

    numel = weight.numel()
    index = torch.zeros(numel, dtype=torch.int64)
    scale = 1
    while scale < numel:
        digit = (torch.arange(numel) // scale % 256).to(weight.dtype).reshape(weight.shape)
        index += ops.cpu_prepack_moe_weight(digit, fused_experts.isa).flatten().to(torch.int64) * scale
        scale *= 256
    if not torch.equal(torch.sort(index).values, torch.arange(numel)):
        raise RuntimeError(f"the CPU experts prepack ({fused_experts.isa}) is not a permutation here")
    out = torch.empty(numel, dtype=weight.dtype, device=weight.device)
    out[index] = weight.detach().flatten()
    return out.reshape(weight.shape)


def _unreadable_experts(model_class: str, module_name: str) -> str | None:
    """Why the fused-MoE module ``module_name`` cannot be read back (None: it can)."""
    from vllm.platforms import current_platform

    if model_class in STACKED_EXPERTS and current_platform.is_cpu():
        return None
    return (
        f"weight readback of fused-MoE module {module_name!r} is not supported; "
        "verify MoE syncs by logprobs instead"
    )


def _stacked_experts(model_class: str, module_name: str, module: torch.nn.Module) -> Iterator[NamedTensor]:
    """The HF stacked expert tensors of one fused-MoE ``module`` of a ``STACKED_EXPERTS`` model."""
    reason = _unreadable_experts(model_class, module_name)
    if reason is not None:
        raise NotImplementedError(reason)
    fused_experts = module.quant_method.moe_kernel.fused_experts
    prefix = module_name.rsplit(".", 1)[0]  # vLLM's routed_experts sits under the HF ``experts``
    for param_name, (hf_leaf, transposed) in STACKED_EXPERTS[model_class].items():
        tensor = getattr(module, param_name, None)
        if tensor is None:
            continue
        tensor = tensor.detach()
        if param_name == "w2_bias" and _zeroed_down_bias(fused_experts.moe_config, tensor):
            continue
        if param_name in ("w13_weight", "w2_weight"):
            tensor = _model_format(tensor, fused_experts)
        yield f"{prefix}.{hf_leaf}", tensor.transpose(1, 2) if transposed else tensor


def _zeroed_down_bias(moe_config: object, bias: torch.Tensor) -> bool:
    """Whether ``bias`` is a down-projection bias that vLLM's GPT-OSS loader zeroed by its own rule:
    with experts split over TP (not expert-parallel) the output is all-reduced, so only TP rank 0
    keeps the bias. Such a worker holds nothing of the trainer's to compare; a nonzero one there is
    reported (and then differs)."""
    return not moe_config.use_ep and moe_config.tp_rank != 0 and not bool(bias.any())


def _unpacked_names(model: torch.nn.Module) -> dict[str, list[str]]:
    return dict(getattr(model, "packed_modules_mapping", {}) or {})


class _Selection:
    """What a ``DigestRequest`` asks of one model, by the vLLM names the readback walks (None: every
    tensor, whole)."""

    def __init__(self, model: torch.nn.Module, request: DigestRequest | None) -> None:
        self.renames = HF_RENAMES.get(type(model).__name__, ())
        self.request = request

    def hf_name(self, name: str) -> str:
        for vllm_part, hf_part in self.renames:
            name = name.replace(vllm_part, hf_part, 1)
        return name

    def wants(self, name: str) -> bool:
        return self.request is None or self.hf_name(name) in self.request.tensors

    def columns(self, name: str, width: int) -> list[int] | None:
        return None if self.request is None else self.request.columns(self.hf_name(name), width)

    def columns_of(self, name: str, tensor: torch.Tensor) -> list[int] | None:
        return None if self.request is None else self.request.columns_of(self.hf_name(name), tensor)


def engine_hf_weights(model: torch.nn.Module, request: DigestRequest | None = None) -> Iterator[NamedTensor]:
    """Yield ``(hf_name, tensor)`` for every weight of a vLLM model, as its kernels see them; with a
    ``request``, only the tensors it names, each on its requested columns."""
    select = _Selection(model, request)
    for name, tensor in _engine_weights(model, select):
        yield select.hf_name(name), tensor


def _engine_weights(model: torch.nn.Module, select: _Selection) -> Iterator[NamedTensor]:
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed = _unpacked_names(model)
    yielded_lm_head = False
    for module_name, module in _weight_modules(model):
        if "w13_weight" in module._parameters:  # fused experts: [E, 2I, H] / [E, H, I], kernel layout
            yield from _selected_experts(model, module_name, module, select)
            continue
        if isinstance(module, VocabParallelEmbedding):
            yielded_lm_head |= module_name == "lm_head"
            name = f"{module_name}.weight"
            if select.wants(name):
                rows = module.shard_indices.num_org_elements
                columns = select.columns(name, module.weight.shape[1])
                yield name, _vocab_weight(module, columns)[:rows]
            continue
        if isinstance(module, LinearBase):
            yield from _linear_parts(module_name, module, packed, select)
            continue
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}"
            if select.wants(name):
                yield name, take_columns(param.detach(), select.columns_of(name, param))
    config = getattr(model, "config", None)
    if (
        getattr(config, "tie_word_embeddings", False)
        and not yielded_lm_head
        and select.wants("lm_head.weight")
    ):
        embed = model.get_submodule("model.embed_tokens")
        weight = embed.weight.detach()[: embed.shard_indices.num_org_elements]
        yield "lm_head.weight", take_columns(weight, select.columns("lm_head.weight", weight.shape[1]))


_WEIGHT_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weight_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules of ``model`` that hold weights (linear and vocab layers, and those with parameters
    of their own), in ``named_modules`` order; found once per model (a sampled check walks them at
    every sync)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if model not in _WEIGHT_MODULES:
        _WEIGHT_MODULES[model] = [
            (name, module)
            for name, module in model.named_modules()
            if isinstance(module, LinearBase | VocabParallelEmbedding) or module._parameters
        ]
    return _WEIGHT_MODULES[model]


def _linear_parts(
    module_name: str, module: torch.nn.Module, packed: dict[str, list[str]], select: _Selection
) -> Iterator[NamedTensor]:
    """A linear layer's weight (and bias) split back into the HF tensors it fuses; read back once,
    on the columns the request picks (the same for every part: ``sampling.sample_columns``)."""
    leaf = module_name.rsplit(".", 1)[-1]
    sizes = list(module.output_partition_sizes)
    prefix = module_name[: -len(leaf)]
    subs = packed[leaf] if leaf in packed and len(sizes) == len(packed[leaf]) > 1 else [leaf]
    names = [f"{prefix}{sub}.weight" for sub in subs]
    wanted = [n for n in names if select.wants(n)]
    if wanted:
        width = getattr(module, "input_size_per_partition", None) or module.input_size
        weight = _linear_weight(module, select.columns(wanted[0], width))
        parts = torch.split(weight, sizes, dim=0) if len(subs) > 1 else [weight]
        yield from ((n, part) for n, part in zip(names, parts) if select.wants(n))
    bias = getattr(module, "bias", None)
    if bias is None or not any(select.wants(f"{prefix}{sub}.bias") for sub in subs):
        return
    parts = torch.split(bias.detach(), sizes, dim=0) if len(subs) > 1 else [bias.detach()]
    for sub, part in zip(subs, parts):
        name = f"{prefix}{sub}.bias"
        if select.wants(name):
            yield name, take_columns(part, select.columns_of(name, part))


def _selected_experts(
    model: torch.nn.Module, module_name: str, module: torch.nn.Module, select: _Selection
) -> Iterator[NamedTensor]:
    """The stacked experts of a fused-MoE module the request names (read whole, then sampled); a
    module the readback cannot read is skipped when the request says so, logged once."""
    model_class = type(model).__name__
    reason = _unreadable_experts(model_class, module_name)
    if reason is not None:
        if select.request is None or not select.request.skip_unsupported:
            raise NotImplementedError(reason)
        global _logged_skip
        if not _logged_skip:
            log.info("weight sync verification skips what it cannot read back: %s", reason)
            _logged_skip = True
        return
    prefix = module_name.rsplit(".", 1)[0]
    if not any(select.wants(f"{prefix}.{leaf}") for leaf, _ in STACKED_EXPERTS.get(model_class, {}).values()):
        return
    for name, tensor in _stacked_experts(model_class, module_name, module):
        if select.wants(name):
            yield name, take_columns(tensor, select.columns_of(name, tensor))


_logged_skip = False
"""Whether this process said once that it skips modules it cannot read back."""


def engine_digests(model: torch.nn.Module, request: DigestRequest | None = None) -> dict[str, str]:
    """``{hf_name: digest}`` of the engine's effective weights (runs where the model lives); with a
    ``request``, of the tensors and columns it names."""
    return {name: tensor_digest(tensor) for name, tensor in engine_hf_weights(model, request)}
