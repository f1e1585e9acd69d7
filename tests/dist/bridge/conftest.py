"""Make this folder's rank functions and the shared gloo harness importable by name (also in spawned
rank processes, which inherit ``sys.path``); the repository uses ``--import-mode=importlib``."""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for folder in (_HERE, _HERE.parent / "megatron"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
