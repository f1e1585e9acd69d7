"""Typing a merged recipe (nested dicts → the config dataclasses) with coercion and strict keys, and
dumping the resolved config.

A section class may define ``expand_shorthand(value) -> dict | None`` to accept one scalar for
the whole section (``actor.policy_loss: gspo`` is ``{loss_mode: gspo}``).

Every problem is collected and reported at once, each with where it came from (``file:line`` or the
override, from :class:`~rltrain.config.recipe.RawConfig`) and the full key path; an unknown key
names the closest valid one. The dump loads back (:func:`~rltrain.config.recipe.read_recipe`) to an
equal config.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, TypeVar, Union

import yaml

from rltrain.config.recipe import ConfigError, RawConfig

T = TypeVar("T")

# ---------------------------------------------------------------------------------------------
# Typing: nested dicts → dataclasses, with coercion and strict keys


def build_dataclass(cls: type[T], raw: RawConfig) -> T:
    """Turn ``raw.data`` into ``cls``; raises :class:`ConfigError` listing every problem."""
    problems: list[str] = []
    all_paths = sorted(_field_paths(cls, ""))
    value = _to_dataclass(cls, raw.data, "", raw, problems, all_paths)
    if problems:
        raise ConfigError(problems)
    return value


def _to_dataclass(cls: type, data: Any, path: str, raw: RawConfig, problems: list[str], all_paths: list[str]):
    expand = getattr(cls, "expand_shorthand", None)  # a section that one value may stand for
    if not isinstance(data, dict) and expand is not None and expand(data) is not None:
        data = expand(data)
    if not isinstance(data, dict):
        problems.append(f"{raw.where(path)}: {path or 'recipe'}: expected a mapping, got {data!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        key_path = f"{path}{key}"
        if key not in names:
            problems.append(
                f"{raw.where(key_path)}: unknown key '{key_path}'{_suggest(key, path, names, all_paths)}"
            )
            continue
        kwargs[key] = _coerce(hints[key], value, key_path, raw, problems, all_paths)
    try:
        return cls(**kwargs)
    except TypeError as err:
        problems.append(f"{raw.where(path)}: {path or 'recipe'}: {err}")
        return None


def _suggest(key: str, parent: str, siblings: set[str], all_paths: list[str]) -> str:
    close = difflib.get_close_matches(key, sorted(siblings), n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{parent}{close[0]}'?"
    elsewhere = [p for p in all_paths if p.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return f"; '{key}' is a key of '{elsewhere[0].rpartition('.')[0]}', did you mean '{elsewhere[0]}'?"
    return f"; valid keys here: {', '.join(sorted(siblings))}"


def _field_paths(cls: type, prefix: str) -> list[str]:
    paths = []
    for name, hint in typing.get_type_hints(cls).items():
        paths.append(prefix + name)
        inner = _dataclass_in(hint)
        if inner is not None:
            paths += _field_paths(inner, f"{prefix}{name}.")
    return paths


def _dataclass_in(hint: Any) -> type | None:
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) is dict:  # dict[str, Section]: the keys are the user's, not fields
        return None
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _coerce(hint: Any, value: Any, path: str, raw: RawConfig, problems: list[str], all_paths: list[str]):
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    where = raw.where(path)
    if origin in (Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            problems.append(f"{where}: {path} may not be null")
            return None
        non_null = [a for a in args if a is not type(None)]
        if len(non_null) == 1:
            return _coerce(non_null[0], value, path, raw, problems, all_paths)
        for candidate in non_null:  # e.g. float | int | str | bool: keep the YAML type if it fits
            if _fits(candidate, value):
                return value
        problems.append(f"{where}: {path}: {value!r} is none of {', '.join(_type_name(a) for a in non_null)}")
        return None
    if dataclasses.is_dataclass(hint):
        return _to_dataclass(hint, {} if value is None else value, path + ".", raw, problems, all_paths)
    if origin is Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint_text = f"; did you mean '{close[0]}'?" if close else ""
        problems.append(f"{where}: {path}: {value!r} is not one of {list(args)}{hint_text}")
        return value
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{where}: {path}: expected a list, got {value!r}")
            return []
        return [_coerce(args[0], v, f"{path}[{i}]", raw, problems, all_paths) for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            problems.append(f"{where}: {path}: expected a list of {len(args)} values, got {value!r}")
            return value
        return tuple(
            _coerce(a, v, f"{path}[{i}]", raw, problems, all_paths)
            for i, (a, v) in enumerate(zip(args, value))
        )
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{where}: {path}: expected a mapping, got {value!r}")
            return {}
        return {
            str(k): _coerce(args[1], v, f"{path}.{k}", raw, problems, all_paths) for k, v in value.items()
        }
    return _coerce_scalar(hint, value, f"{where}: {path}", problems)


def _coerce_scalar(hint: Any, value: Any, label: str, problems: list[str]):
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        problems.append(f"{label}: expected true or false, got {value!r}")
        return value
    if hint in (int, float):
        number = _parse_number(value)
        if number is None:
            problems.append(f"{label}: expected {hint.__name__}, got {value!r}")
            return value
        if hint is int:
            if not float(number).is_integer():  # also NaN and infinity
                problems.append(f"{label}: expected an integer, got {value!r}")
                return value
            return int(number)
        return float(number)
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        problems.append(f"{label}: expected a string, got {value!r}")
        return value
    raise TypeError(f"config field type {hint!r} at {label} is not supported by the loader")


def _parse_number(value: Any) -> float | int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return value
    if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
        try:
            return int(value)
        except ValueError:
            try:
                return float(value)
            except ValueError:
                return None
    return None


def _fits(hint: Any, value: Any) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, float)
    if hint is str:
        return isinstance(value, str)
    return False


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))


# ---------------------------------------------------------------------------------------------
# Dumping


def to_plain(value: Any) -> Any:
    """Dataclasses → dicts, tuples → lists: what ``yaml.safe_dump`` accepts."""
    if dataclasses.is_dataclass(value):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def dump_yaml(config: Any, *, header: str = "") -> str:
    """The resolved config as YAML that :func:`read_recipe` loads back to an equal config."""
    text = yaml.safe_dump(to_plain(config), sort_keys=False, default_flow_style=False)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + text
