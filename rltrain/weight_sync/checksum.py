"""Digests that prove an engine holds what the trainer sent: SHA-256 of a tensor's bytes after
casting to the engine dtype (what vLLM's loader does with ``copy_``), so equal digests mean
bit-identical weights. The engine side reads its effective weights back in
``rltrain.rollout.vllm.checksum``; the trainer side digests the shards it planned for each worker.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from rltrain.weight_sync.types import NamedTensor


def tensor_digest(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """SHA-256 hex digest of ``tensor``'s bytes (after casting to ``dtype`` when given)."""
    t = tensor.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    data = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


def digests(named_tensors: Iterable[NamedTensor], dtype: torch.dtype | None = None) -> dict[str, str]:
    """``{hf_name: digest}`` of the trainer-side tensors (cast to the engine dtype)."""
    return {name: tensor_digest(tensor, dtype) for name, tensor in named_tensors}


def compare_digests(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Problems (one line each) for every expected name missing from or differing in ``actual``."""
    problems = []
    for name, digest in expected.items():
        if name not in actual:
            problems.append(f"{name}: sent by the trainer but not found among the engine's weights")
        elif actual[name] != digest:
            problems.append(f"{name}: engine weights differ from the trainer's (sha256 mismatch)")
    return problems
