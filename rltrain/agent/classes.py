"""Resolve a class named in a tools or interactions file: a registered name or a dotted path."""

from __future__ import annotations

import importlib


def lookup_class(name: str, registry: dict[str, type], base: type) -> type | None:
    """``registry[name]``, else the ``base`` subclass at the dotted path ``name``; None when neither
    names one. An unimportable module raises ``ImportError``."""
    if name in registry:
        return registry[name]
    module, _, attr = name.rpartition(".")
    cls = getattr(importlib.import_module(module), attr, None) if module else None
    return cls if isinstance(cls, type) and issubclass(cls, base) else None
