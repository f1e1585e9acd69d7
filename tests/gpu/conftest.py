"""Make this folder's helper modules, the Megatron test fixtures (``tests/dist/megatron``) and the
repository root importable by name, also in spawned rank processes (they inherit ``sys.path``); the
repository runs pytest with ``--import-mode=importlib``, which adds none of them."""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _path in (_HERE, _HERE.parent / "dist" / "megatron", _HERE.parents[1]):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
