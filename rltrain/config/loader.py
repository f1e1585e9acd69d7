"""YAML recipes → typed config: strict keys, ``base:`` inheritance, dotted overrides, resolved dump.

A recipe is a YAML mapping whose keys mirror :class:`rltrain.config.RLConfig`. ``base:`` names one
recipe (or a list, applied in order) that this one extends; paths are relative to the recipe. Later
sources win key by key; lists are replaced, not concatenated. Command-line overrides
(``actor.optim.lr=1e-6``) are applied last; their values are parsed as YAML (``null``, ``true``,
``[1, 2]``).

Every problem is collected and reported at once, each with where it came from (``file:line`` or the
override) and the full key path; an unknown key names the closest valid one, a key given twice in
one mapping names both lines. Range and cross-field problems (the components' ``validate``) name
their keys by full dotted path; :meth:`RawConfig.locate` puts the origin of each named key that was
set (not left at its default) in front.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A user's mistake in a recipe, an override, a combination of values or the data they name.

    The message lists every problem, one line each; the command line prints it without a traceback.
    """

    def __init__(self, problems: list[str]):
        self.problems = problems
        if len(problems) == 1:
            super().__init__(f"invalid configuration: {problems[0]}")
        else:
            super().__init__("invalid configuration:\n  - " + "\n  - ".join(problems))


@dataclasses.dataclass
class RawConfig:
    """A merged recipe before typing: nested dicts plus where each key was last set."""

    data: dict[str, Any]
    origins: dict[str, str]
    """Dotted key path → ``file:line`` or ``override 'a.b=1'``."""

    def where(self, path: str) -> str:
        """The origin of ``path`` (``a.b``, a list item ``a.b[2]``) or of its nearest set ancestor."""
        while path:
            if path in self.origins:
                return self.origins[path]
            path = _parent(path)
        return "<defaults>"

    def is_set(self, path: str) -> bool:
        """Whether ``path`` holds a value given by a recipe or an override (not a default)."""
        value: Any = self.data
        for part in _KEY_PART.findall(path):
            if part.startswith("["):
                index = int(part[1:-1])
                if not isinstance(value, list) or index >= len(value):
                    return False
                value = value[index]
            elif isinstance(value, dict) and part in value:
                value = value[part]
            else:
                return False
        return True

    def locate(self, problem: str) -> str:
        """``problem`` with the origins of the set keys it names in front (``file:line, override '...': ...``)."""
        origins = []
        for key in _KEY_PATH.findall(problem):
            if self.is_set(key) and self.where(key) not in origins:
                origins.append(self.where(key))
        return f"{', '.join(origins)}: {problem}" if origins else problem


_KEY_PATH = re.compile(r"(?<![\w./-])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\[\d+\])*")
"""A dotted key path as problems name it: ``actor.optim.lr``, ``data.train_files[1]``."""

_KEY_PART = re.compile(r"[^.\[\]]+|\[\d+\]")


def _parent(path: str) -> str:
    """``a.b[1]`` -> ``a.b`` -> ``a`` -> ``''``."""
    if path.endswith("]"):
        return path[: path.rindex("[")]
    return path.rpartition(".")[0]


def _is_under(path: str, key: str) -> bool:
    """Whether ``path`` is ``key`` or lies inside it (a sub-key or a list item)."""
    return path == key or path.startswith((key + ".", key + "["))


# ---------------------------------------------------------------------------------------------
# Reading YAML with line numbers and base inheritance


def read_recipe(path: str | Path, _stack: tuple[Path, ...] = ()) -> RawConfig:
    """Read ``path`` and its ``base:`` chain into one :class:`RawConfig`."""
    path = Path(path).resolve()
    if path in _stack:
        chain = " -> ".join(str(p) for p in (*_stack, path))
        raise ConfigError([f"{path}: circular base: {chain}"])
    if not path.is_file():
        where = f" (base of {_stack[-1]})" if _stack else ""
        raise ConfigError([f"recipe file not found: {path}{where}"])
    data, origins = _load_yaml_with_lines(path)
    bases = data.pop("base", None)
    origins.pop("base", None)
    merged = RawConfig({}, {})
    for base in [bases] if isinstance(bases, str) else bases or []:
        if not isinstance(base, str):
            raise ConfigError([f"{path}: 'base' must be a file name or a list of them, got {base!r}"])
        parent = read_recipe(path.parent / base, (*_stack, path))
        _merge_into(merged, parent.data, parent.origins, "")
    _merge_into(merged, data, origins, "")
    return merged


def _load_yaml_with_lines(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ConfigError([f"{path}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x})"]) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ConfigError([f"{path}{line}: not valid YAML: {getattr(err, 'problem', err)}"]) from err
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}:1: a recipe must be a mapping of sections, got {type(data).__name__}"])
    origins: dict[str, str] = {}
    duplicates: list[str] = []
    _collect_lines(node, "", path, origins, duplicates)
    if duplicates:
        raise ConfigError(duplicates)
    return data, origins


def _collect_lines(
    node: yaml.Node, prefix: str, path: Path, out: dict[str, str], duplicates: list[str]
) -> None:
    """Record the line of every key and list item under ``prefix``; name keys given twice."""
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            key = f"{prefix}[{i}]"
            out[key] = f"{path}:{item.start_mark.line + 1}"
            _collect_lines(item, key, path, out, duplicates)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    first_line: dict[str, int] = {}
    for key_node, value_node in node.value:
        key = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
        line = key_node.start_mark.line + 1
        if key in first_line:
            duplicates.append(
                f"{path}:{line}: duplicate key '{key}' (first at line {first_line[key]}); "
                "YAML would keep only the last"
            )
        first_line.setdefault(key, line)
        out[key] = f"{path}:{line}"
        _collect_lines(value_node, key, path, out, duplicates)


def _merge_into(dst: RawConfig, data: dict[str, Any], origins: dict[str, str], prefix: str) -> None:
    target = dst.data
    for part in prefix.split(".")[:-1] if prefix else []:
        target = target[part]
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge_into(dst, value, origins, path + ".")
        else:
            target[key] = _copy(value)
            for stale in [p for p in dst.origins if _is_under(p, path) and p != path]:
                del dst.origins[stale]
            _copy_origins(origins, path, dst.origins)
        dst.origins[path] = origins.get(path, dst.origins.get(path, "<unknown>"))


def _copy_origins(src: dict[str, str], path: str, dst: dict[str, str]) -> None:
    for key, where in src.items():
        if _is_under(key, path):
            dst[key] = where


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def apply_overrides(raw: RawConfig, overrides: list[str]) -> None:
    """Apply ``a.b.c=value`` strings in order; values are parsed as YAML."""
    problems = []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(
                f"override {item!r}: expected KEY=VALUE with a dotted key, e.g. actor.optim.lr=1e-6"
            )
            continue
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as err:
            problems.append(f"override {item!r}: value is not valid YAML ({err})")
            continue
        *parents, leaf = key.split(".")
        target = raw.data
        for depth, part in enumerate(parents):
            child = target.get(part)
            if not isinstance(child, dict):
                section = ".".join(parents[: depth + 1])
                if child is not None:
                    problems.append(f"override {item!r}: {section} is a value, not a section")
                    break
                child = target[part] = {}
                raw.origins[section] = f"override '{item}'"  # a section the override brings in
            target = child
        else:
            target[leaf] = value
            for stale in [p for p in raw.origins if _is_under(p, key)]:
                del raw.origins[stale]
            raw.origins[key] = f"override '{item}'"
    if problems:
        raise ConfigError(problems)


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
