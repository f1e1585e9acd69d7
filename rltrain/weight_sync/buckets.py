"""Weight buckets: HF-named tensors grouped into ~``bucket_bytes`` units and packed into one flat buffer.

Contract:
- ``iter_buckets`` keeps the stream order and never splits a *fused group* (the HF tensors that
  vLLM loads into one module: q/k/v → ``qkv_proj``, gate/up → ``gate_up_proj``, all experts of one
  layer → one fused-MoE module). vLLM's in-place reload processes a module once all its elements
  arrived; a group cut between two reload calls would be processed half-loaded. A single group
  larger than ``bucket_bytes`` becomes one oversized bucket.
- ``pack_bucket`` copies a bucket into one contiguous uint8 buffer plus per-tensor metadata (into
  a buffer the caller keeps, when given: ``BufferPool``); ``unpack_bucket`` returns views into that
  buffer (no copy), bit-identical to the inputs.
- ``BufferPool`` hands out flat buffers that outlive one sync: a bucket's buffer is written again
  only after the engine took the bucket in, so no sync after the first allocates (fresh large
  buffers page-fault on every touch, which made the bucketed receive slower than a naive load).
Pure torch; no vLLM, no process groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

from megatron_bridge.vllm_names import fused_group

NamedTensor = tuple[str, torch.Tensor]
T = TypeVar("T")


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(
    named_tensors: Iterable[tuple[str, T]],
    bucket_bytes: int,
    *,
    packed_modules: dict[str, str] | None = None,
    weigh: Callable[[T], int] = tensor_bytes,  # type: ignore[assignment]
) -> Iterator[list[tuple[str, T]]]:
    """Yield lists of (name, item) of about ``bucket_bytes`` each (an item weighs ``weigh(item)``:
    a tensor its bytes), cut only between fused groups.

    Tensors of one fused group must arrive adjacent in the stream (as HF checkpoints and the bridge's
    export order them); a group that reappears after another started raises, naming both.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: list[tuple[str, T]] = []
    size = 0
    group: list[tuple[str, T]] = []
    group_key: str | None = None
    group_size = 0
    closed: set[str] = set()
    for name, tensor in named_tensors:
        key = fused_group(name, packed_modules)
        if key != group_key:
            if key in closed:
                raise ValueError(
                    f"weight stream is not grouped: {name!r} belongs to fused module {key!r}, "
                    f"which already ended before {group[-1][0] if group else '?'}; send the members of a fused "
                    "module adjacently (grouped_order() reorders a state dict)"
                )
            if group_key is not None:
                closed.add(group_key)
                if bucket and size + group_size > bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
                bucket.extend(group)
                size += group_size
            group, group_key, group_size = [], key, 0
        group.append((name, tensor))
        group_size += weigh(tensor)
    if group:
        if bucket and size + group_size > bucket_bytes:
            yield bucket
            bucket = []
        bucket.extend(group)
    if bucket:
        yield bucket


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lies in a packed bucket."""

    name: str
    """HF parameter name."""
    shape: tuple[int, ...]
    """Tensor shape."""
    dtype: torch.dtype
    """Element type."""
    offset: int
    """Byte offset of the first element in the flat buffer (aligned to 16 bytes)."""


@dataclass
class PackedBucket:
    """One bucket as a single contiguous buffer."""

    metas: list[TensorMeta]
    """Per-tensor metadata, in stream order."""
    flat: torch.Tensor
    """[num_bytes] uint8 buffer holding every tensor's bytes at its ``offset``."""


_ALIGN = 16


def bucket_layout(bucket: list[NamedTensor]) -> tuple[list[TensorMeta], int]:
    """Metadata of ``bucket`` packed in order, and the total byte size of the flat buffer."""
    metas = []
    offset = 0
    for name, tensor in bucket:
        metas.append(TensorMeta(name, tuple(tensor.shape), tensor.dtype, offset))
        offset += -(-tensor_bytes(tensor) // _ALIGN) * _ALIGN
    return metas, offset


def pack_bucket(
    bucket: list[NamedTensor], *, device: torch.device | str = "cpu", pool: BufferPool | None = None
) -> PackedBucket:
    """Copy ``bucket`` into one flat uint8 buffer on ``device`` (``pool``'s next buffer when given)."""
    metas, num_bytes = bucket_layout(bucket)
    flat = (
        pool.take(num_bytes) if pool is not None else torch.empty(num_bytes, dtype=torch.uint8, device=device)
    )
    for meta, (_, tensor) in zip(metas, bucket):
        nbytes = tensor_bytes(tensor)
        flat[meta.offset : meta.offset + nbytes].copy_(
            tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        )
    return PackedBucket(metas, flat)


def unpack_bucket(packed: PackedBucket) -> list[NamedTensor]:
    """Views into ``packed.flat``, one per tensor, with the original names, shapes and dtypes."""
    out = []
    for meta in packed.metas:
        numel = 1
        for dim in meta.shape:
            numel *= dim
        nbytes = numel * torch.empty((), dtype=meta.dtype).element_size()
        view = packed.flat[meta.offset : meta.offset + nbytes].view(meta.dtype).view(meta.shape)
        out.append((meta.name, view))
    return out


class BufferPool:
    """Flat uint8 buffers reused across buckets and syncs, on one device.

    ``take(num_bytes)`` returns the next of ``num_buffers`` buffers in turn (each grown to the largest
    size asked of it, never shrunk), as a view of exactly ``num_bytes``. The caller must be done
    with a buffer before it comes round again: with one buffer, the previous bucket must have been
    loaded by the time the next one is received.
    """

    def __init__(self, *, device: torch.device | str = "cpu", num_buffers: int = 1) -> None:
        if num_buffers < 1:
            raise ValueError(f"num_buffers must be >= 1, got {num_buffers}")
        self.device = torch.device(device)
        self._buffers: list[torch.Tensor | None] = [None] * num_buffers
        self._next = 0

    def take(self, num_bytes: int) -> torch.Tensor:
        index = self._next
        self._next = (self._next + 1) % len(self._buffers)
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < num_bytes:
            buffer = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
            self._buffers[index] = buffer
        return buffer[:num_bytes]
