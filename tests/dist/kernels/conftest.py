"""Make this folder's rank functions, the shared gloo harness (``tests/dist/megatron``) and the
top-level ``kernels`` package importable by name, also in spawned rank processes (which inherit
``sys.path``); the repository uses ``--import-mode=importlib`` and the editable install maps only
``rltrain`` and ``megatron_bridge``."""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _folder in (_HERE, _HERE.parent / "megatron", _HERE.parents[2]):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
