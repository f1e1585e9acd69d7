"""Name -> function registries for algorithm variants.

Contract: every variant of an algorithm (an advantage estimator, a KL estimator, a policy loss, a KL
controller) is a plain function registered under a string name, the name used in recipes
(``adv_estimator: grpo``, ``kl_penalty: low_var_kl``, ``policy_loss: vanilla``). Looking up an
unknown name fails loudly with the registered names and the closest match, so a typo in a recipe
is fixed in one read. Registering the same name twice is an error, never a silent override.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """A name that is not registered; catchable as ``KeyError`` or ``ValueError``."""

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message and wrap it in quotes.
        return str(self.args[0])


class Registry(Generic[T]):
    """A named collection of variants of one kind (e.g. ``"advantage estimator"``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator that registers the decorated object under ``name`` and returns it unchanged."""

        def decorator(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered to {self._entries[name]!r}")
            self._entries[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        """The object registered under ``name``; raises ``UnknownNameError`` naming the choices."""
        if name in self._entries:
            return self._entries[name]
        close = difflib.get_close_matches(name, self._entries, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UnknownNameError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}{hint}")

    def problems(self, name: str, key: str) -> list[str]:
        """A config check: ``[]`` when ``name`` is registered, else one line naming ``key``, the
        registered names and the closest one."""
        try:
            self.get(name)
        except KeyError as err:
            return [f"{key}: {err}"]
        return []

    def names(self) -> tuple[str, ...]:
        """Registered names, sorted."""
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={list(self.names())})"
