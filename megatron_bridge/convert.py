"""The layout pieces of checkpoint conversion: round-trip comparison, the HF writer, the reshard source.

Contract (torch only; the conversion ranks and the CLI that use these live in ``rltrain/convert/``):
- ``compare_bit_exact(expected, actual, what)`` compares every tensor of two readers (the interface
  of ``hf_io.HFCheckpointReader``: ``names``, ``get``) bit-for-bit, one tensor at a time, and
  returns how many it compared; names, shapes, dtypes and bytes must all agree, else it raises
  ``errors.VerificationError`` naming ``what`` and the tensors (at most 20 of each kind).
- ``write_hf(view, out, aux_from=, progress=)`` writes every tensor of an HF-named reader as a
  safetensors directory, one tensor at a time, and copies the config, tokenizer and generation
  config from ``aux_from``.
- ``reshard_source(stored)`` is the streamed Megatron writer's source for resharding: each stored
  region of the target layout read from the old checkpoint (``dcp_io.DistCheckpointReader``). Only
  the vocabulary rows of the embedding and output layer may differ in length (padding for another
  TP); any other shape change raises naming the checkpoint and the key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from megatron_bridge.errors import VerificationError
from megatron_bridge.hf_io import SafetensorsWriter, copy_hf_aux_files


def compare_bit_exact(expected: Any, actual: Any, what: str) -> int:
    """Compare every tensor of two readers bit-for-bit, one at a time; raises naming the differences."""
    if sorted(expected.names()) != sorted(actual.names()):
        missing = sorted(set(expected.names()) - set(actual.names()))
        unexpected = sorted(set(actual.names()) - set(expected.names()))
        raise VerificationError(
            f"{what}: missing tensors {missing[:20]}; unexpected tensors {unexpected[:20]}"
        )
    bad = []
    for name in expected.names():
        ref, got = expected.get(name), actual.get(name)
        if got.dtype != ref.dtype or got.shape != ref.shape or not torch.equal(got, ref):
            bad.append(f"{name} ({tuple(got.shape)} {got.dtype} vs {tuple(ref.shape)} {ref.dtype})")
    if bad:
        raise VerificationError(f"{what}: round trip differs for {bad[:20]}")
    return len(expected.names())


def write_hf(view: Any, out: Path, *, aux_from: Path, progress: bool) -> None:
    """Write every tensor of ``view`` (an HF-named reader) as a safetensors directory, one at a time."""
    writer = SafetensorsWriter(out, [(n, view.info(n).shape, view.info(n).dtype) for n in view.names()])
    for name in _progress(view.names(), progress, "write HF checkpoint"):
        writer.write(name, view.get(name))
    writer.close()
    copy_hf_aux_files(aux_from, out)


def _progress(items: list[str], enabled: bool, desc: str) -> Iterable[str]:
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="tensor")


_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def reshard_source(stored: Any) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The streamed writer's source for mcore-to-mcore: each stored region read from the old checkpoint."""

    def source(region: Any, placeholder: torch.Tensor) -> torch.Tensor:
        have = stored.shape(region.key)
        vocab = region.key in _VOCAB_KEYS and have[1:] == region.global_shape[1:]
        if have != region.global_shape and not vocab:
            raise ValueError(
                f"{stored.directory}: {region.key!r} is stored as {have}; the target layout expects "
                f"{region.global_shape}"
            )
        return stored.read(region.key, region.offsets, region.sizes, pad_rows=vocab).view(placeholder.shape)

    return source
