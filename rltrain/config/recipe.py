"""Reading recipes: YAML with line numbers, ``base:`` inheritance, dotted overrides, origins of values.

A recipe is a YAML mapping whose keys mirror :class:`rltrain.config.RLConfig`. ``base:`` names one
recipe (or a list, applied in order) that this one extends; paths are relative to the recipe. Later
sources win key by key; lists are replaced, not concatenated. Command-line overrides
(``actor.optim.lr=1e-6``) are applied last; their values are parsed as YAML (``null``, ``true``,
``[1, 2]``). The result is a :class:`RawConfig`: nested dicts plus where each key (and list item)
was last set, ``file:line`` or the override; a section an override brings in is the override's.

A key given twice in one mapping is an error naming both lines; so is a byte that is not UTF-8.
Problems that name keys by full dotted path (range and cross-field checks) get the origins of
those keys put in front by :meth:`RawConfig.locate`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml


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
    """The merged sections, as YAML gave them (nested dicts, lists, scalars)."""

    origins: dict[str, str]
    """Dotted key path (list items as ``a.b[2]``) → ``file:line`` or ``override 'a.b=1'``."""

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
