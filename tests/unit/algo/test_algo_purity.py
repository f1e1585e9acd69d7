"""rltrain.algo imports with Megatron, vLLM and Ray made unimportable."""

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
ALGO_DIR = REPO_ROOT / "rltrain" / "algo"

_BLOCKER = """
import sys

BLOCKED = {"megatron", "vllm", "ray"}


class BlockHeavyImports:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"rltrain.algo must not import {name}")
        return None


sys.meta_path.insert(0, BlockHeavyImports())
"""


def _run(body: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _BLOCKER + body],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_algo_imports_without_megatron_vllm_ray():
    modules = sorted(p.stem for p in ALGO_DIR.glob("*.py") if p.stem != "__init__")
    assert {"advantages", "kl", "losses", "masked", "registry"} <= set(modules)
    imports = "".join(f"import rltrain.algo.{name}\n" for name in modules)
    leak_check = (
        "leaked = sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED)\nassert not leaked, leaked\n"
    )
    result = _run("import rltrain.algo\n" + imports + leak_check)
    assert result.returncode == 0, result.stderr


def test_the_blocker_really_blocks():
    result = _run("import ray\n")
    assert result.returncode != 0
    assert "rltrain.algo must not import ray" in result.stderr
