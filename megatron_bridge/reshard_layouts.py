"""``TensorLayout``s for the reshard planner (``megatron_bridge.reshard``): read off the weight
bridge's mapping tables (``layouts_from_bridge``), or written by hand for a Llama-style decoder
(``decoder_layouts``, tests and the sync-plan simulator). Pure: strings and shapes.
"""

from __future__ import annotations

from typing import Any

from megatron_bridge import mappings as m
from megatron_bridge.naming import match
from megatron_bridge.reshard import SplitKind, TensorLayout
from megatron_bridge.vllm_names import vllm_replicates


def decoder_layouts(
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    tie_word_embeddings: bool,
    num_experts: int = 0,
) -> list[TensorLayout]:
    """Layouts of a Llama-style decoder in HF naming (Qwen2-MoE-style experts when ``num_experts``)."""
    h, q, kv = hidden_size, num_heads * head_dim, num_kv_heads * head_dim
    out = [TensorLayout("model.embed_tokens.weight", (vocab_size, h), "vocab")]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        out += [
            TensorLayout(p + "input_layernorm.weight", (h,), "replicated", layer=i),
            TensorLayout(p + "self_attn.q_proj.weight", (q, h), "column", layer=i),
            TensorLayout(p + "self_attn.k_proj.weight", (kv, h), "kv_heads", layer=i, head_dim=head_dim),
            TensorLayout(p + "self_attn.v_proj.weight", (kv, h), "kv_heads", layer=i, head_dim=head_dim),
            TensorLayout(p + "self_attn.o_proj.weight", (h, q), "row", layer=i),
            TensorLayout(p + "post_attention_layernorm.weight", (h,), "replicated", layer=i),
        ]
        if num_experts:
            out.append(TensorLayout(p + "mlp.gate.weight", (num_experts, h), "replicated", layer=i))
        for e in range(num_experts) if num_experts else [None]:
            mlp = p + ("mlp." if e is None else f"mlp.experts.{e}.")
            out += [
                TensorLayout(mlp + "gate_proj.weight", (intermediate_size, h), "column", layer=i, expert=e),
                TensorLayout(mlp + "up_proj.weight", (intermediate_size, h), "column", layer=i, expert=e),
                TensorLayout(mlp + "down_proj.weight", (h, intermediate_size), "row", layer=i, expert=e),
            ]
    out.append(TensorLayout("model.norm.weight", (h,), "replicated", last_stage=True))
    if not tie_word_embeddings:
        out.append(TensorLayout("lm_head.weight", (vocab_size, h), "vocab", last_stage=True))
    return out


# ---- layouts read off the bridge's mapping tables -------------------------------------------------
#
# ``TensorLayout``s for the planner, read off the weight bridge's declarative mapping tables.
#
# The bridge's typed mappings already know how each tensor splits (``megatron_bridge.mappings``); this
# translates them, HF tensor by HF tensor, into the planner's split kinds:
#
# | bridge mapping                | HF tensors → planner split                          |
# |-------------------------------|-----------------------------------------------------|
# | ``Replicated``                | replicated                                          |
# | ``ColumnParallel``/``RowParallel`` | column / row                                   |
# | ``VocabParallel``             | vocab (embedding on the first stage, head on the last) |
# | ``QKV``                       | q: column, k/v: kv_heads (``head_dim`` rows a head) |
# | ``GatedMLP``                  | gate, up: column                                    |
# | ``PerExpert(inner)``          | ``inner``'s kinds, with the expert index            |
# | ``GroupedExperts(inner)``     | stacked: ``inner``'s kind, split along the HF dim of ``inner.hf_split_dim`` + 1 |
#
# Layer and expert indices come from matching each HF name against the mapping's own HF pattern.
# ``FusedGatedMLP`` (an HF tensor holding ``[gate; up]``: each TP rank's piece is two blocks, which
# vLLM narrows half by half) raises ``NotImplementedError`` naming the tensor.


def _kinds(mapping: Any, head_dim: int) -> list[tuple[SplitKind, int]]:
    """(split kind, head_dim) for each HF tensor of ``mapping``, in ``hf_patterns()`` order."""
    inner = mapping.inner if isinstance(mapping, m.PerExpert | m.GroupedExperts) else mapping
    if isinstance(mapping, m.GroupedExperts):
        return [("replicated" if inner.tp_dim is None else "column", 1)]
    if isinstance(inner, m.FusedGatedMLP):
        raise NotImplementedError(
            f"{type(inner).__name__} ({inner.hf_patterns()[0]}): an HF tensor that is itself fused; "
            "the reshard planner splits unfused HF tensors only, so live weight sync cannot serve this family"
        )
    if isinstance(inner, m.QKV):
        return [("column", 1), ("kv_heads", head_dim), ("kv_heads", head_dim)]
    if isinstance(inner, m.GatedMLP):
        return [("column", 1), ("column", 1)]
    if isinstance(inner, m.VocabParallel):
        return [("vocab", 1)]
    if isinstance(inner, m.RowParallel):
        return [("row", 1)]
    if isinstance(inner, m.ColumnParallel):
        return [("column", 1)]
    if isinstance(inner, m.Replicated) or inner.tp_dim is None:
        return [("replicated", 1)]
    raise NotImplementedError(
        f"no planner split for bridge mapping {type(inner).__name__} ({inner.megatron})"
    )


def layouts_from_bridge(bridge: Any, shapes: dict[str, tuple[int, ...]]) -> list[TensorLayout]:
    """Layouts of every exported (untied) HF tensor of ``bridge`` (a ``megatron_bridge.bridge.Bridge``).

    ``shapes`` maps HF names to full shapes (an HF checkpoint's, or ``megatron_bridge.live.hf_plan``).
    """
    layouts = []
    for unit in bridge.units:
        if unit.tied:
            continue
        patterns = unit.mapping.hf_patterns()
        kinds = _kinds(unit.mapping, bridge.dims.head_dim)
        stacked = isinstance(unit.mapping, m.GroupedExperts)
        for hf_name, pattern, (kind, head_dim) in zip(unit.hf_names, patterns, kinds):
            if hf_name not in shapes:
                raise KeyError(f"no shape given for HF tensor {hf_name!r}")
            shape = tuple(shapes[hf_name])
            values = match(pattern, hf_name) or ()
            dim = None
            if stacked and kind != "replicated":
                dim = 1 + unit.mapping.inner.hf_split_dim(len(shape) - 1)
            layouts.append(
                TensorLayout(
                    hf_name,
                    shape,
                    kind,
                    layer=values[0] if values else None,
                    last_stage=not values and not unit.mapping.megatron.startswith("embedding."),
                    expert=values[1] if unit.is_expert and not stacked else None,
                    head_dim=head_dim,
                    engine_replicated=kind != "replicated" and vllm_replicates(hf_name),
                    stacked=stacked,
                    dim=dim,
                )
            )
    return layouts
