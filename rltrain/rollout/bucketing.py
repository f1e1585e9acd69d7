"""Weight buckets: HF-named tensors grouped into ~``bucket_bytes`` units and packed into one flat buffer.

Contract:
- ``iter_buckets`` keeps the stream order and never splits a *fused group* (the HF tensors that
  vLLM loads into one module: q/k/v → ``qkv_proj``, gate/up → ``gate_up_proj``, all experts of one
  layer → one fused-MoE module). vLLM's in-place reload processes a module once all its elements
  arrived; a group cut between two reload calls would be processed half-loaded. A single group
  larger than ``bucket_bytes`` becomes one oversized bucket.
- ``pack_bucket`` copies a bucket into one contiguous uint8 buffer plus per-tensor metadata;
  ``unpack_bucket`` returns views into that buffer (no copy), bit-identical to the inputs.
Pure torch; no vLLM, no process groups.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

NamedTensor = tuple[str, torch.Tensor]

# HF sub-module → vLLM fused module, the packing every vLLM decoder family in scope uses.
DEFAULT_PACKED_MODULES: dict[str, str] = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def fused_group(hf_name: str, packed_modules: dict[str, str] | None = None) -> str:
    """Name of the vLLM module that ``hf_name`` is loaded into (the unit a bucket must not split)."""
    packed = DEFAULT_PACKED_MODULES if packed_modules is None else packed_modules
    expert = _EXPERT_INDEX.search(hf_name)
    if expert is not None:
        return hf_name[: expert.start()] + ".experts"
    parts = hf_name.split(".")
    module = parts[:-1]
    if module and module[-1] in packed:
        module = [*module[:-1], packed[module[-1]]]
    return ".".join(module)


def grouped_order(
    named_tensors: Iterable[NamedTensor], packed_modules: dict[str, str] | None = None
) -> list[NamedTensor]:
    """``named_tensors`` reordered so that the members of each fused module are adjacent
    (stable otherwise: modules keep the order of their first member)."""
    items = list(named_tensors)
    first: dict[str, int] = {}
    for i, (name, _) in enumerate(items):
        first.setdefault(fused_group(name, packed_modules), i)
    return sorted(items, key=lambda kv: first[fused_group(kv[0], packed_modules)])


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(
    named_tensors: Iterable[NamedTensor],
    bucket_bytes: int,
    *,
    packed_modules: dict[str, str] | None = None,
) -> Iterator[list[NamedTensor]]:
    """Yield lists of (name, tensor) of about ``bucket_bytes`` each, cut only between fused groups.

    Tensors of one fused group must arrive adjacent in the stream (as HF checkpoints and the bridge's
    export order them); a group that reappears after another started raises, naming both.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: list[NamedTensor] = []
    size = 0
    group: list[NamedTensor] = []
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
        group_size += tensor_bytes(tensor)
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


def pack_bucket(bucket: list[NamedTensor], *, device: torch.device | str = "cpu") -> PackedBucket:
    """Copy ``bucket`` into one flat uint8 buffer on ``device``."""
    metas, num_bytes = bucket_layout(bucket)
    flat = torch.empty(num_bytes, dtype=torch.uint8, device=device)
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
