"""Whether a GPU test can run here: a CUDA device, and the packages it needs (found, not imported).

Every test module of this folder starts with ``pytestmark = gpu_only(...)``: the ``gpu`` marker
(``tools/gpu_check.sh`` selects by it) and a skip that names what is missing. Without a GPU the
tests are collected and skipped without importing Megatron, transformers or rltrain's Megatron side.
"""

from __future__ import annotations

import importlib.util

import pytest


def skip_reason(packages: tuple[str, ...]) -> str:
    """Why a GPU test needing ``packages`` (top-level module names) cannot run here; "" when it can."""
    import torch

    reasons = []
    if not torch.cuda.is_available():
        reasons.append("needs a CUDA device (torch.cuda.is_available() is False)")
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        reasons.append(f"needs the packages {', '.join(missing)} (tools/gpu_check.sh installs them)")
    return "; ".join(reasons)


def gpu_only(*packages: str) -> list[pytest.MarkDecorator]:
    """The marks of a GPU test module: ``gpu``, and a skip naming the missing device or packages."""
    reason = skip_reason(packages)
    return [pytest.mark.gpu, pytest.mark.skipif(bool(reason), reason=reason or "runs")]
