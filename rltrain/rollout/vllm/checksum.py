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
Dense decoders are covered; a fused-MoE module raises, naming it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rltrain.weight_sync.checksum import tensor_digest
from rltrain.weight_sync.types import NamedTensor


def _linear_weight(module: torch.nn.Module) -> torch.Tensor:
    """The [out, in] weight a (possibly prepacked) linear layer computes with."""
    weight = module.weight
    if weight.numel() > 0:
        return weight.detach()
    cpu_linear = getattr(module, "cpu_linear", None)
    if cpu_linear is None:
        raise RuntimeError(f"{type(module).__name__}: empty weight and no cpu_linear kernel to read back")
    eye = torch.eye(module.input_size_per_partition, dtype=weight.dtype, device=weight.device)
    with torch.inference_mode():
        return cpu_linear(eye, None, None).t().contiguous()


def _vocab_weight(module: torch.nn.Module) -> torch.Tensor:
    """An embedding's weight; for an LM head with a CPU kernel, the packed copy its logits GEMM uses
    (a tied head keeps its own copy of the embedding; reading the shared parameter would miss a
    stale copy)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    weight = module.weight.detach()
    cpu_linear = getattr(module, "cpu_linear", None)
    if not isinstance(module, ParallelLMHead) or cpu_linear is None:
        return weight
    eye = torch.eye(weight.shape[1], dtype=weight.dtype, device=weight.device)
    with torch.inference_mode():
        return cpu_linear(eye, weight, None).t().contiguous()


def _unpacked_names(model: torch.nn.Module) -> dict[str, list[str]]:
    return dict(getattr(model, "packed_modules_mapping", {}) or {})


def engine_hf_weights(model: torch.nn.Module) -> Iterator[NamedTensor]:
    """Yield ``(hf_name, tensor)`` for every weight of a vLLM model, as its kernels see them."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed = _unpacked_names(model)
    yielded_lm_head = False
    for module_name, module in model.named_modules():
        if hasattr(module, "w13_weight"):  # fused experts: [E, 2I, H] / [E, H, I], kernel-specific layout
            raise NotImplementedError(
                f"weight readback of fused-MoE module {module_name!r} is not supported; "
                "verify MoE syncs by logprobs instead"
            )
        if isinstance(module, VocabParallelEmbedding):
            rows = module.shard_indices.num_org_elements
            yield f"{module_name}.weight", _vocab_weight(module)[:rows]
            yielded_lm_head |= module_name == "lm_head"
            continue
        if isinstance(module, LinearBase):
            weight = _linear_weight(module)
            leaf = module_name.rsplit(".", 1)[-1]
            sizes = list(module.output_partition_sizes)
            if leaf in packed and len(sizes) == len(packed[leaf]) > 1:
                prefix = module_name[: -len(leaf)]
                for sub, part in zip(packed[leaf], torch.split(weight, sizes, dim=0)):
                    yield f"{prefix}{sub}.weight", part
                if getattr(module, "bias", None) is not None:
                    for sub, part in zip(packed[leaf], torch.split(module.bias.detach(), sizes, dim=0)):
                        yield f"{prefix}{sub}.bias", part
            else:
                yield f"{module_name}.weight", weight
                if getattr(module, "bias", None) is not None:
                    yield f"{module_name}.bias", module.bias.detach()
            continue
        for param_name, param in module.named_parameters(recurse=False):
            yield f"{module_name}.{param_name}", param.detach()
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and not yielded_lm_head:
        embed = model.get_submodule("model.embed_tokens")
        yield "lm_head.weight", embed.weight.detach()[: embed.shard_indices.num_org_elements]


def engine_digests(model: torch.nn.Module) -> dict[str, str]:
    """``{hf_name: digest}`` of the engine's effective weights (runs where the model lives)."""
    return {name: tensor_digest(tensor) for name, tensor in engine_hf_weights(model)}
