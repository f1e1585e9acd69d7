"""Registry of model-family tables keyed by HF ``model_type``.

Contract: ``get_family(model_type)`` returns the registered ``FamilyTable`` or raises ``KeyError``
listing every supported ``model_type``. Tables register themselves when ``megatron_bridge.models``
is imported, which ``get_family`` does on first use.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_bridge.mappings import AnyMapping


@dataclass(frozen=True)
class FamilyTable:
    """The mapping rows of one model family, written in canonical Megatron names."""

    name: str
    model_types: tuple[str, ...]
    mappings: tuple[AnyMapping, ...]


_FAMILIES: dict[str, FamilyTable] = {}


def register(table: FamilyTable) -> FamilyTable:
    for model_type in table.model_types:
        if model_type in _FAMILIES and _FAMILIES[model_type] is not table:
            raise ValueError(
                f"model_type {model_type!r} is already registered by {_FAMILIES[model_type].name}"
            )
        _FAMILIES[model_type] = table
    return table


def supported_model_types() -> list[str]:
    import megatron_bridge.models  # noqa: F401  (registers the tables)

    return sorted(_FAMILIES)


def get_family(model_type: str) -> FamilyTable:
    supported = supported_model_types()
    if model_type not in _FAMILIES:
        raise KeyError(
            f"no weight bridge for HF model_type={model_type!r}; supported model types: {', '.join(supported)}"
        )
    return _FAMILIES[model_type]
