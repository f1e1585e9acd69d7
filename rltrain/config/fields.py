"""Number field types with a lower bound, and the one walk that checks every numeric config value.

Contract: a config field that is a size or a count is typed :data:`PositiveInt` (1 or more); one
where 0 means "none" or "off" is :data:`NonNegativeInt` (its docstring says what 0 does). The same
holds for floats (:data:`PositiveFloat`, :data:`NonNegativeFloat`). Fields whose negative values mean
something (``top_k: -1`` disables, ``save_freq: -1`` saves only at the end) stay plain ``int`` and
their component's ``validate`` checks them. :func:`field_problems` walks a config by its type hints
and reports every value below its bound and every float that is NaN or infinite, wherever it sits
(fields, list and tuple items, mapping values), each naming its full dotted key.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any


@dataclass(frozen=True)
class AtLeast:
    """Lower bound of an annotated number field."""

    bound: float
    """The smallest valid value (or the largest invalid one with ``exclusive``)."""

    exclusive: bool = False
    """Whether the bound itself is invalid (``> 0`` rather than ``>= 0``)."""

    def problem(self, key: str, value: float) -> str | None:
        """The message for ``value`` at ``key``, or None when it is within the bound."""
        ok = value > self.bound if self.exclusive else value >= self.bound
        if ok:
            return None
        bound = int(self.bound) if float(self.bound).is_integer() else self.bound
        return f"{key} must be {'>' if self.exclusive else '>='} {bound}, got {value}"


PositiveInt = Annotated[int, AtLeast(1)]
"""A size or a count: 1 or more."""

NonNegativeInt = Annotated[int, AtLeast(0)]
"""A count or a number of steps where 0 means none (the field docstring says what 0 does)."""

PositiveFloat = Annotated[float, AtLeast(0, exclusive=True)]
"""A strictly positive amount (a learning rate, a memory size, an epsilon)."""

NonNegativeFloat = Annotated[float, AtLeast(0)]
"""An amount where 0 means off (the field docstring says what 0 does)."""


def field_problems(config: Any, prefix: str = "") -> list[str]:
    """Every out-of-bound or non-finite number in the dataclass ``config``, keys under ``prefix``."""
    problems: list[str] = []
    _check(type(config), config, prefix.rstrip("."), problems)
    return problems


def _check(hint: Any, value: Any, key: str, problems: list[str]) -> None:
    if value is None:
        return
    if dataclasses.is_dataclass(value):
        hints = typing.get_type_hints(type(value), include_extras=True)
        for f in dataclasses.fields(value):
            _check(hints[f.name], getattr(value, f.name), f"{key}.{f.name}" if key else f.name, problems)
        return
    if isinstance(value, float) and not math.isfinite(value):
        problems.append(f"{key} must be a finite number, got {value}")
        return
    if isinstance(value, int | float) and not isinstance(value, bool):
        for bound in _bounds(hint):
            message = bound.problem(key, value)
            if message:
                problems.append(message)
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check(_item_hint(hint, i), item, f"{key}[{i}]", problems)
    elif isinstance(value, dict):
        args = typing.get_args(_strip_optional(hint))
        for name, item in value.items():
            _check(args[1] if len(args) == 2 else Any, item, f"{key}.{name}", problems)


def _bounds(hint: Any) -> list[AtLeast]:
    """The bounds an ``Annotated`` hint (or an optional one) carries."""
    if typing.get_origin(hint) is Annotated:
        return [m for m in hint.__metadata__ if isinstance(m, AtLeast)]
    return [b for arg in typing.get_args(hint) for b in _bounds(arg)]


def _strip_optional(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return hint


def _item_hint(hint: Any, index: int) -> Any:
    hint = _strip_optional(hint)
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) > index and args[-1] is not Ellipsis:
        return args[index]
    return args[0] if args else Any
