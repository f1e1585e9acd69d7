"""``TensorLayout``s for the planner, read off the weight bridge's declarative mapping tables.

The bridge's typed mappings already know how each tensor splits (``megatron_bridge.mappings``); this
translates them, HF tensor by HF tensor, into the planner's split kinds:

| bridge mapping                | HF tensors → planner split                          |
|-------------------------------|-----------------------------------------------------|
| ``Replicated``                | replicated                                          |
| ``ColumnParallel``/``RowParallel`` | column / row                                   |
| ``VocabParallel``             | vocab (embedding on the first stage, head on the last) |
| ``QKV``                       | q: column, k/v: kv_heads (``head_dim`` rows a head) |
| ``GatedMLP``                  | gate, up: column                                    |
| ``PerExpert(inner)``          | ``inner``'s kinds, with the expert index            |

Layer and expert indices come from matching each HF name against the mapping's own HF pattern.
Mappings whose HF tensor is itself fused or stacked (``FusedGatedMLP``, ``GroupedExperts``: vLLM
splits each half / each expert on its side) raise ``NotImplementedError`` naming the tensor.
"""

from __future__ import annotations

from typing import Any

from rltrain.rollout.planner import SplitKind, TensorLayout


def _kinds(mapping: Any, head_dim: int) -> list[tuple[SplitKind, int]]:
    """(split kind, head_dim) for each HF tensor of ``mapping``, in ``hf_patterns()`` order."""
    from megatron_bridge import mappings as m

    inner = mapping.inner if isinstance(mapping, m.PerExpert) else mapping
    if isinstance(inner, m.FusedGatedMLP | m.GroupedExperts):
        raise NotImplementedError(
            f"{type(inner).__name__} ({inner.hf_patterns()[0]}): an HF tensor that is itself fused; "
            "the planner splits unfused HF tensors only"
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
    from megatron_bridge.naming import match

    layouts = []
    for unit in bridge.units:
        if unit.tied:
            continue
        patterns = unit.mapping.hf_patterns()
        kinds = _kinds(unit.mapping, bridge.dims.head_dim)
        for hf_name, pattern, (kind, head_dim) in zip(unit.hf_names, patterns, kinds):
            if hf_name not in shapes:
                raise KeyError(f"no shape given for HF tensor {hf_name!r}")
            values = match(pattern, hf_name) or ()
            layouts.append(
                TensorLayout(
                    hf_name,
                    tuple(shapes[hf_name]),
                    kind,
                    layer=values[0] if values else None,
                    last_stage=not values and not unit.mapping.megatron.startswith("embedding."),
                    expert=values[1] if unit.is_expert else None,
                    head_dim=head_dim,
                )
            )
    return layouts
