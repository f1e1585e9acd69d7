"""Registry of model families keyed by HF ``model_type``.

Contract: ``get_family(model_type)`` returns the registered ``ModelFamily``, raises
``NotImplementedError`` with the one-line reason for a recognized but refused ``model_type``
(``megatron_bridge.refused``), or ``KeyError`` listing every supported ``model_type``;
``registered_family(model_type)`` returns it or None. ``supported_model_types()`` lists every
``model_type`` a checkpoint may have (Kimi-K2's ``kimi_k2`` among them); ``family_types()`` one per
family, its first: the one with a transformers config class and the family's tiny preset (tiny
models and per-family test tables use these).
Families register themselves when ``megatron_bridge.models`` is imported (every module there but
``common``), which each of these functions does on first use.
"""

from __future__ import annotations

from megatron_bridge.family import ModelFamily

_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    for model_type in family.model_types:
        if model_type in _FAMILIES and _FAMILIES[model_type] is not family:
            raise ValueError(
                f"model_type {model_type!r} is already registered by {_FAMILIES[model_type].name}"
            )
        _FAMILIES[model_type] = family
    return family


def supported_model_types() -> list[str]:
    import megatron_bridge.models  # noqa: F401  (registers the families)

    return sorted(_FAMILIES)


def family_types() -> list[str]:
    """The first ``model_type`` of each family (``kimi_k2`` is DeepSeek-V3's second: not here)."""
    import megatron_bridge.models  # noqa: F401  (registers the families)

    return sorted({family.model_types[0] for family in _FAMILIES.values()})


def registered_family(model_type: str) -> ModelFamily | None:
    """The family of ``model_type``, or None for a type no family serves."""
    import megatron_bridge.models  # noqa: F401  (registers the families)

    return _FAMILIES.get(model_type)


def refusal(model_type: str) -> str | None:
    """The one-line reason a recognized but unsupported ``model_type`` is refused, or None."""
    from megatron_bridge.refused import REFUSED

    return REFUSED.get(model_type)


def get_family(model_type: str) -> ModelFamily:
    reason = refusal(model_type)
    if reason is not None:
        raise NotImplementedError(reason)
    supported = supported_model_types()
    if model_type not in _FAMILIES:
        raise KeyError(
            f"no weight bridge for HF model_type={model_type!r}; supported model types: {', '.join(supported)}"
        )
    return _FAMILIES[model_type]
