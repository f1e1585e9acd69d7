"""Import boundaries and one definition per top-level name, read from the source (ast; nothing imported).

Rules (``../shared/DESIGN.md``, principle 2), over every ``.py`` under ``rltrain/`` and
``megatron_bridge/`` (and, for ``tools``, ``tests/`` and ``bench/`` too):
- ``megatron.core`` only under ``rltrain/megatron/``;
- ``vllm`` only under ``rltrain/rollout/vllm/`` (the vLLM backend; the rest of ``rollout/`` is the
  engine protocol every backend shares);
- ``ray`` only under ``rltrain/orchestrator/``;
- the driver-side ``rltrain/trainer/`` and the per-rank ``rltrain/workers/`` do not import each other
  (what they exchange lives in ``data/``, ``algo/`` and ``config/``); the trainer imports no ray,
  ``megatron.core`` or vllm, not even through another module (checked by importing it);
- ``megatron_bridge`` imports nothing of ``rltrain``;
- ``rltrain/rewards/`` imports nothing of ``rltrain.agent`` (both use ``rltrain.sandbox``);
- nothing imports a top-level package named ``tools`` (``tools/`` holds launch scripts only);
- a module defines each top-level name once (``def``, ``class`` or assignment; ``@overload`` stubs
  excepted): ruff's F811 misses a function redefined after other code.
Every import counts wherever it sits (inside functions, ``try`` or ``if`` blocks), as do
``importlib.import_module("...")`` and ``__import__("...")`` with a literal name; relative imports
are resolved against the module's package. Each failure names the file, the line and the rule.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Rule:
    name: str
    """What the rule says, as a failure message names it."""
    module: str
    """The imported package the rule is about (it and its submodules)."""
    allowed: Callable[[str], bool]
    """Whether a file (path relative to the repository root, with ``/``) may import ``module``."""
    scope: tuple[str, ...] = ("rltrain", "megatron_bridge")
    """Top-level folders whose files the rule checks."""


RULES = (
    Rule(
        "megatron.core only under rltrain/megatron/",
        "megatron.core",
        lambda path: path.startswith("rltrain/megatron/"),
    ),
    Rule(
        "vllm only under rltrain/rollout/vllm/", "vllm", lambda path: path.startswith("rltrain/rollout/vllm/")
    ),
    Rule(
        "ray only under rltrain/orchestrator/", "ray", lambda path: path.startswith("rltrain/orchestrator/")
    ),
    Rule(
        "rltrain/trainer/ imports nothing of rltrain.workers",
        "rltrain.workers",
        lambda path: not path.startswith("rltrain/trainer/"),
    ),
    Rule(
        "rltrain/workers/ imports nothing of rltrain.trainer",
        "rltrain.trainer",
        lambda path: not path.startswith("rltrain/workers/"),
    ),
    Rule(
        "megatron_bridge imports nothing of rltrain",
        "rltrain",
        lambda path: not path.startswith("megatron_bridge/"),
    ),
    Rule(
        "rltrain/rewards/ imports nothing of rltrain.agent",
        "rltrain.agent",
        lambda path: not path.startswith("rltrain/rewards/"),
    ),
    Rule(
        "no top-level package named tools is imported",
        "tools",
        lambda path: False,
        scope=("rltrain", "megatron_bridge", "tests", "bench"),
    ),
)


# ---- checkers (pure: a path and its source in, messages out) -----------------------------------
def _absolute(path: str, module: str | None, level: int) -> str:
    """The absolute module a (possibly relative) ``from ... import`` names in the file ``path``."""
    if level == 0:
        return module or ""
    package = path.split("/")[:-1]  # a module's package, and an __init__.py's own
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, *([module] if module else [])])


def imported_modules(path: str, source: str) -> Iterator[tuple[int, str]]:
    """(line, dotted module) of every import in ``source``; ``from a import b`` yields ``a`` and ``a.b``."""
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(path, node.module, node.level)
            if module:
                yield node.lineno, module
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{module}.{alias.name}" if module else alias.name
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield node.lineno, first.value


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def import_violations(path: str, source: str, rules: tuple[Rule, ...] = RULES) -> list[str]:
    """``path:line: imports MODULE (rule: ...)`` for each line of ``source`` importing what a rule forbids."""
    top = path.split("/", 1)[0]
    out = []
    for rule in rules:
        if top not in rule.scope or rule.allowed(path):
            continue
        first_by_line: dict[int, str] = {}
        for line, module in imported_modules(path, source):
            if _within(module, rule.module) and len(module) < len(first_by_line.get(line, module + ".")):
                first_by_line[line] = module  # ``from a.b import c``: name a.b, not a.b.c
        out += [
            f"{path}:{line}: imports {m} (rule: {rule.name})" for line, m in sorted(first_by_line.items())
        ]
    return out


def _defined_names(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        overload = any(
            (isinstance(d, ast.Name) and d.id == "overload")
            or (isinstance(d, ast.Attribute) and d.attr == "overload")
            for d in node.decorator_list
        )
        return [] if overload else [node.name]
    if isinstance(node, ast.ClassDef):
        return [node.name]
    targets = node.targets if isinstance(node, ast.Assign) else []
    if isinstance(node, ast.AnnAssign) and node.value is not None:
        targets = [node.target]
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def duplicate_definitions(path: str, source: str) -> list[str]:
    """``path:line: NAME defined again (first at line L)`` for each top-level name defined twice."""
    first: dict[str, int] = {}
    out = []
    for node in ast.parse(source, filename=path).body:
        for name in _defined_names(node):
            if name in first:
                out.append(
                    f"{path}:{node.lineno}: {name} defined again, first at line {first[name]} "
                    "(rule: a module defines each top-level name once)"
                )
            else:
                first[name] = node.lineno
    return out


# ---- the tree -----------------------------------------------------------------------------------
@cache
def _sources(*tops: str) -> tuple[tuple[str, str], ...]:
    files = sorted(p for top in tops for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)
    return tuple((p.relative_to(ROOT).as_posix(), p.read_text()) for p in files)


@pytest.mark.parametrize("rule", RULES, ids=[r.module for r in RULES])
def test_import_boundary(rule):
    violations = [v for path, src in _sources(*rule.scope) for v in import_violations(path, src, (rule,))]
    assert not violations, "\n".join(violations)


def test_no_module_defines_a_top_level_name_twice():
    violations = [
        v for path, src in _sources("rltrain", "megatron_bridge") for v in duplicate_definitions(path, src)
    ]
    assert not violations, "\n".join(violations)


def test_the_scan_sees_the_imports_the_rules_allow():
    """The checks are not vacuous: each allowed home really imports its package, as parsed here."""
    homes = {
        "megatron.core": "rltrain/megatron/",
        "vllm": "rltrain/rollout/vllm/",
        "ray": "rltrain/orchestrator/",
    }
    for package, home in homes.items():
        found = [
            path
            for path, src in _sources("rltrain")
            if path.startswith(home) and any(_within(m, package) for _, m in imported_modules(path, src))
        ]
        assert found, f"no file under {home} imports {package}: the scan reads nothing"


def test_the_trainer_loads_no_ray_megatron_or_vllm():
    """Importing every trainer module (as the driver does) loads none of them, through any module."""
    modules = sorted(
        "rltrain.trainer." + p.stem
        for p in (ROOT / "rltrain" / "trainer").glob("*.py")
        if p.stem != "__init__"
    )
    assert "rltrain.trainer.driver" in modules
    probe = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted({m.split('.')[0] if not m.startswith('megatron.core') else 'megatron.core'"
        " for m in sys.modules if m.split('.')[0] in ('ray', 'vllm') or m.startswith('megatron.core')}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing rltrain/trainer/ loads {out.stdout.strip()}"


# ---- the checkers flag what they should ---------------------------------------------------------
def test_import_checker_flags_each_rule_with_file_and_line():
    nested = "import os\n\n\ndef f():\n    from megatron.core import parallel_state\n"
    assert import_violations("rltrain/algo/x.py", nested) == [
        "rltrain/algo/x.py:5: imports megatron.core (rule: megatron.core only under rltrain/megatron/)"
    ]
    assert import_violations("rltrain/megatron/x.py", nested) == []
    assert import_violations("rltrain/data/x.py", "from megatron import core\n") == [
        "rltrain/data/x.py:1: imports megatron.core (rule: megatron.core only under rltrain/megatron/)"
    ]
    assert import_violations(
        "rltrain/orchestrator/x.py", "try:\n    import vllm.engine\nexcept ImportError:\n    pass\n"
    ) == ["rltrain/orchestrator/x.py:2: imports vllm.engine (rule: vllm only under rltrain/rollout/vllm/)"]
    assert import_violations("rltrain/rollout/vllm/x.py", "import ray\nimport rayon\nimport vllm\n") == [
        "rltrain/rollout/vllm/x.py:1: imports ray (rule: ray only under rltrain/orchestrator/)"
    ]
    assert import_violations("rltrain/rollout/partial.py", "from vllm.outputs import RequestOutput\n") == [
        "rltrain/rollout/partial.py:1: imports vllm.outputs (rule: vllm only under rltrain/rollout/vllm/)"
    ]
    assert import_violations("megatron_bridge/x.py", "from rltrain.megatron.model import build_model\n") == [
        "megatron_bridge/x.py:1: imports rltrain.megatron.model (rule: megatron_bridge imports nothing of rltrain)"
    ]
    assert import_violations("megatron_bridge/models/x.py", "from ..hf_io import TensorInfo\n") == []
    assert import_violations("rltrain/x.py", "import importlib\nimportlib.import_module('ray.util')\n") == [
        "rltrain/x.py:2: imports ray.util (rule: ray only under rltrain/orchestrator/)"
    ]
    assert import_violations("tests/unit/x.py", "from tools.convert_ckpt import run\n") == [
        "tests/unit/x.py:1: imports tools.convert_ckpt (rule: no top-level package named tools is imported)"
    ]
    assert import_violations("rltrain/rollout/agent.py", "from .tools import call_tool\n") == []
    assert import_violations(
        "rltrain/trainer/x.py", "from rltrain.workers.ppo_losses import actor_loss_fn\n"
    ) == [
        "rltrain/trainer/x.py:1: imports rltrain.workers.ppo_losses (rule: rltrain/trainer/ imports nothing of "
        "rltrain.workers)"
    ]
    assert import_violations("rltrain/workers/x.py", "def f():\n    from ..trainer import driver\n") == [
        "rltrain/workers/x.py:2: imports rltrain.trainer (rule: rltrain/workers/ imports nothing of rltrain.trainer)"
    ]
    assert import_violations("rltrain/trainer/x.py", "import ray\nfrom vllm import LLM\n") == [
        "rltrain/trainer/x.py:2: imports vllm (rule: vllm only under rltrain/rollout/vllm/)",
        "rltrain/trainer/x.py:1: imports ray (rule: ray only under rltrain/orchestrator/)",
    ]
    assert import_violations("rltrain/trainer/x.py", "from megatron.core import tensor_parallel\n") == [
        "rltrain/trainer/x.py:1: imports megatron.core (rule: megatron.core only under rltrain/megatron/)"
    ]
    assert import_violations("rltrain/orchestrator/x.py", "from rltrain.trainer import driver\n") == []


def test_relative_imports_resolve_against_the_package():
    got = list(
        imported_modules("rltrain/convert/ranks.py", "from ..megatron import model\nfrom . import cli\n")
    )
    assert got == [
        (1, "rltrain.megatron"),
        (1, "rltrain.megatron.model"),
        (2, "rltrain.convert"),
        (2, "rltrain.convert.cli"),
    ]
    assert list(imported_modules("rltrain/convert/__init__.py", "from .report import MODES\n")) == [
        (1, "rltrain.convert.report"),
        (1, "rltrain.convert.report.MODES"),
    ]


def test_duplicate_checker_flags_a_second_top_level_definition():
    source = (
        "def _step_metrics(x):\n    return x\n\n"
        "LIMIT = 1\n"
        "class Worker:\n    def _step_metrics(self):\n        pass\n\n"
        "def _step_metrics(x, y):\n    return y\n"
        "LIMIT: int = 2\n"
        "a, (b, LIMIT) = 1, (2, 3)\n"
    )
    assert duplicate_definitions("rltrain/orchestrator/w.py", source) == [
        "rltrain/orchestrator/w.py:9: _step_metrics defined again, first at line 1 "
        "(rule: a module defines each top-level name once)",
        "rltrain/orchestrator/w.py:11: LIMIT defined again, first at line 4 "
        "(rule: a module defines each top-level name once)",
        "rltrain/orchestrator/w.py:12: LIMIT defined again, first at line 4 "
        "(rule: a module defines each top-level name once)",
    ]
    overloads = (
        "from typing import overload\n\n"
        "@overload\ndef f(x: int) -> int: ...\n"
        "@overload\ndef f(x: str) -> str: ...\n"
        "def f(x):\n    return x\n"
        "if True:\n    g = 1\nelse:\n    g = 2\n"
    )
    assert duplicate_definitions("rltrain/x.py", overloads) == []


def test_import_checker_flags_rewards_importing_the_agent():
    planted = "def run():\n    from rltrain.agent.tools.sandbox import PythonSandboxTool\n"
    assert import_violations("rltrain/rewards/code_exec.py", planted) == [
        "rltrain/rewards/code_exec.py:2: imports rltrain.agent.tools.sandbox "
        "(rule: rltrain/rewards/ imports nothing of rltrain.agent)"
    ]
    assert import_violations("rltrain/rewards/tool_use.py", "from ..agent import loop\n") == [
        "rltrain/rewards/tool_use.py:1: imports rltrain.agent "
        "(rule: rltrain/rewards/ imports nothing of rltrain.agent)"
    ]
    assert import_violations("rltrain/rewards/code_exec.py", "from rltrain.sandbox import run_python\n") == []
    assert import_violations("rltrain/agent/tools/sandbox.py", "from rltrain.agent.tools import base\n") == []
