"""Rollout engine backends by name (``rollout.name``, verl's key): what builds a backend's engines
and reads its own options from the config.

A backend is one folder under ``rltrain/rollout/`` whose ``backend`` module defines ``BACKEND``, an
``EngineBackend``; the built-in ones are listed in ``_BUILTIN`` and imported at their first use, so
that reading a config never imports an engine. ``register_backend`` adds one at run time (tests).
Pure module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rltrain.rollout.protocol import EngineSettings, RolloutEngine

_BUILTIN = {"vllm": "rltrain.rollout.vllm.backend"}
"""``rollout.name`` -> the module whose ``BACKEND`` it is."""

_registered: dict[str, EngineBackend] = {}


@dataclass(frozen=True)
class EngineBackend:
    """One engine backend."""

    name: str
    """Its ``rollout.name``."""

    build: Callable[..., RolloutEngine]
    """``build(model_dir, settings, *, asynchronous, partial_rollout)``: an engine for the HF model in
    ``model_dir``; ``asynchronous`` (``rollout.uses_async_engine()``) asks for an
    ``AsyncRolloutEngine``, with ``partial_rollout`` (``rollout.partial_rollout``)."""

    options_from_config: Callable[[Any], Any] = lambda rollout_config: None
    """The backend's ``EngineSettings.options`` from ``rltrain.config.rollout.RolloutConfig``."""

    def settings(self, rollout_config: Any) -> EngineSettings:
        """``EngineSettings.from_rollout_config`` with this backend's options."""
        return EngineSettings.from_rollout_config(
            rollout_config, options=self.options_from_config(rollout_config)
        )


def backend_names() -> tuple[str, ...]:
    """Every known ``rollout.name``, sorted."""
    return tuple(sorted({*_BUILTIN, *_registered}))


def get_backend(name: str) -> EngineBackend:
    """The backend called ``name``; an unknown name raises ``LookupError`` naming the known ones."""
    if name not in _registered:
        if name not in _BUILTIN:
            raise LookupError(f"unknown rollout engine {name!r}; known: {', '.join(backend_names())}")
        _registered[name] = importlib.import_module(_BUILTIN[name]).BACKEND
    return _registered[name]


def register_backend(backend: EngineBackend) -> EngineBackend:
    """Add ``backend`` under ``backend.name`` (a name already known is an error, never an override)."""
    if backend.name in _registered or backend.name in _BUILTIN:
        raise ValueError(f"rollout engine {backend.name!r} is already registered")
    _registered[backend.name] = backend
    return backend


def unregister_backend(name: str) -> None:
    """Remove a backend added by ``register_backend`` (tests clean up with it)."""
    if name in _BUILTIN:
        raise ValueError(f"rollout engine {name!r} is built in")
    _registered.pop(name, None)
