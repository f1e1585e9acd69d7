"""Make the top-level ``kernels`` package importable: the editable install maps only ``rltrain`` and
``megatron_bridge``, and the repository runs pytest with ``--import-mode=importlib``."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
