"""The configuration reference as Markdown, rendered from the config dataclasses and their field docstrings.

The docs site's "Config reference" page is this text, rendered when the site is built
(``docs/hooks/config_reference.py``), so the page lists every key the loader accepts with its type,
default and docstring, and cannot fall behind the code. Field docstrings are not kept at runtime;
they are read from the source with ``ast``, as ``tests/unit/config/test_field_docs.py`` checks that
every field has one.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rltrain.config.rl import RLConfig

INTRO = """\
# Config reference

Every key a recipe may set, section by section, with its type, its default and what it does: the
docstrings of the dataclasses in `rltrain/config/`, rendered when this site is built. A section
whose own key defaults to `null` is off until the recipe sets it (or one of its keys). Keys follow
verl's names where verl has one; [Configuration and recipes](configuration.md) says how recipes,
`base:` and command-line overrides combine."""


@dataclass
class Row:
    """One key of the reference table."""

    key: str
    """The full dotted key (``trainer.checkpoint.max_ckpt_to_keep``)."""

    type: str
    """The annotation as written in the source."""

    default: str
    """The default as Markdown (a code span, or ``required``)."""

    doc: str
    """The field's docstring."""


@dataclass
class Section:
    """One dataclass reached from :class:`RLConfig`: its dotted path, its docstring and its plain keys."""

    path: str
    """Dotted path of the section (``""`` for :class:`RLConfig` itself)."""

    doc: str
    """What the parent's field and the class say about the section."""

    rows: list[Row]
    """Its keys that are not sections themselves (an optional section's key is a row too)."""


def _docs(cls: type) -> tuple[str, dict[str, str]]:
    """The class docstring and the docstring under each annotated field, from the source."""
    node = ast.parse(inspect.cleandoc("\n" + inspect.getsource(cls))).body[0]
    assert isinstance(node, ast.ClassDef)
    fields: dict[str, str] = {}
    for stmt, nxt in zip(node.body, [*node.body[1:], None]):
        field = isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
        if field and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            fields[stmt.target.id] = inspect.cleandoc(str(nxt.value.value))
    return inspect.cleandoc(ast.get_docstring(node) or ""), fields


def _one_line(text: str) -> str:
    """``text`` on one line for a table cell: ``|`` escaped outside code spans (inside them the
    table extension leaves it alone, and an escape would show)."""
    parts = re.split(r"(``.*?``|`[^`]*`)", " ".join(text.split()))
    return "".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _shown(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "required"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    if isinstance(value, (int, float)):
        return f"`{value}`"
    return f"`{json.dumps(value, default=str)}`"


def _nested(hint: Any) -> tuple[type | None, str]:
    """The dataclass a field holds, and how: ``""`` (always), ``"optional"`` (or null), ``"dict"`` (by name)."""
    if dataclasses.is_dataclass(hint):
        return hint, ""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if dataclasses.is_dataclass(a)]
        if inner:
            return inner[0], "optional"
    if origin is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return args[1], "dict"
    return None, ""


def sections(cls: type = RLConfig, path: str = "", doc: str = "", instance: Any = None) -> Iterator[Section]:
    """Every section under ``cls`` in field order, depth first: a section, then its sub-sections.

    Defaults are those of ``instance`` (the default :class:`RLConfig` at the top), so a section a
    parent builds with other defaults (the critic's optimizer) shows the parent's; a section that
    defaults to null, or one of a map by name, shows its class's own."""
    if instance is None and cls is RLConfig and not path:
        instance = RLConfig()
    class_doc, field_docs = _docs(cls)
    hints = typing.get_type_hints(cls)
    rows: list[Row] = []
    below: list[tuple[type, str, str, Any]] = []
    for f in dataclasses.fields(cls):
        key = f"{path}.{f.name}" if path else f.name
        value = getattr(instance, f.name) if instance is not None else _field_default(f)
        nested, how = _nested(hints[f.name])
        if nested is None or how:
            rows.append(Row(key, str(f.type), _shown(value), field_docs.get(f.name, "")))
        if nested is not None:
            sub = f"{key}.<name>" if how == "dict" else key
            below.append((nested, sub, field_docs.get(f.name, ""), value if how == "" else None))
    yield Section(path, "\n\n".join(d for d in (doc, class_doc) if d), rows)
    for nested, sub, sub_doc, sub_instance in below:
        yield from sections(nested, sub, sub_doc, sub_instance)


def render() -> str:
    """The whole reference page as Markdown."""
    parts = [INTRO]
    for section in sections():
        if not section.path:  # RLConfig itself: its fields are the sections below
            assert not section.rows, section.rows
            continue
        parts.append(f"## `{section.path}`")
        if section.doc:
            parts.append(" ".join(section.doc.split()))
        if section.rows:
            table = ["| key | type | default | description |", "|---|---|---|---|"]
            table += [
                f"| `{r.key}` | {_one_line(r.type)} | {_one_line(r.default)} | {_one_line(r.doc)} |"
                for r in section.rows
            ]
            parts.append("\n".join(table))
    return "\n\n".join(parts) + "\n"
