"""The data, reward and logging modules import without megatron, vllm or ray."""

from __future__ import annotations

import subprocess
import sys
import textwrap

MODULES = [
    "rltrain.data.dataset",
    "rltrain.data.prompt_rows",
    "rltrain.data.tasks",
    "rltrain.data.loader",
    "rltrain.rewards",
    "rltrain.logging",
    "rltrain.logging.plot",
]


def test_modules_import_with_heavy_frameworks_blocked() -> None:
    script = textwrap.dedent(
        f"""
        import importlib, sys

        BLOCKED = ("megatron", "vllm", "ray")

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"blocked import of {{name}}")
                return None

        sys.meta_path.insert(0, Block())
        for module in {MODULES!r}:
            importlib.import_module(module)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
