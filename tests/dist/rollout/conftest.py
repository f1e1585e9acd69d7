"""Put this folder on ``sys.path`` so that its helper modules (``rank_launch``) import by name; the
repository runs pytest with ``--import-mode=importlib``, which does not add test folders."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
