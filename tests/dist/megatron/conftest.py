"""Make this folder's helper modules importable by name (also in spawned rank processes, which
inherit ``sys.path``); the repository uses ``--import-mode=importlib``, which does not."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
