"""Every config field carries a docstring (the string literal right after it)."""

import ast
import dataclasses
from pathlib import Path

import pytest

import rltrain.config as config_pkg

CONFIG_DIR = Path(config_pkg.__file__).parent
MODULES = sorted(p for p in CONFIG_DIR.glob("*.py") if p.name not in ("__init__.py", "loader.py"))


def undocumented_fields(source: str) -> list[str]:
    missing = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                nxt = body[i + 1] if i + 1 < len(body) else None
                documented = (
                    isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                )
                if not documented:
                    missing.append(f"{node.name}.{stmt.target.id}")
    return missing


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_every_field_has_a_docstring(path):
    assert undocumented_fields(path.read_text()) == []


def test_checker_catches_an_undocumented_field():
    assert undocumented_fields("class A:\n    x: int = 1\n    y: int = 2\n    '''doc'''\n") == ["A.x"]


def test_all_components_are_dataclasses_with_fields():
    names = {f.name for f in dataclasses.fields(config_pkg.RLConfig)}
    assert names == {
        "model",
        "data",
        "actor",
        "ref",
        "critic",
        "rollout",
        "algorithm",
        "reward",
        "trainer",
        "cluster",
    }
