"""Read any region of any tensor of a Megatron distributed checkpoint, one region at a time.

Contract (torch only, no Megatron, no process group): ``DistCheckpointReader(step_dir)`` opens one
``step_<n>`` directory written by ``dist_checkpointing.save`` in the torch_dist format (PyTorch DCP
files plus ``.metadata``). ``read(key, offsets, sizes)`` returns the region ``[offsets, offsets +
sizes)`` of the global tensor ``key`` (Megatron's sharded key; global coordinates include the
prepended layer / expert axes) as a new tensor, assembled from every stored chunk that overlaps it,
whatever layout wrote them. Only the stored chunks that overlap are read, each once, so memory is
the region plus the largest overlapping stored chunk. ``pad_rows=True`` lets the region run past
the stored rows of dimension 0 (a vocabulary padded for another TP size); those rows are zeros.
Unknown keys, regions outside the tensor and regions the stored chunks do not cover raise naming
the key and the directory. An unreadable ``.metadata``, a shard file that is missing or shorter than
the metadata says (checked when the reader opens), and stored bytes that do not load (an overwritten
shard, found when read) raise ``errors.CheckpointError`` naming the file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_bridge.errors import CheckpointError


class _IntoTensor:
    """The two planner calls ``FileSystemReader.read_data`` makes for tensor items: write into ``out``."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out
        self.filled = 0

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        view = self.out
        for dim, (start, length) in enumerate(zip(item.dest_offsets, item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        self.filled += tensor.numel()

    def load_bytes(self, item: ReadItem, value: Any) -> None:  # pragma: no cover - tensors only
        raise TypeError(f"{item.dest_index.fqn} is a bytes item, not a tensor")


class DistCheckpointReader:
    """Regions of the tensors stored in one Megatron (torch_dist) checkpoint directory."""

    def __init__(self, step_dir: str | Path) -> None:
        self.directory = Path(step_dir)
        if not (self.directory / ".metadata").exists():
            raise FileNotFoundError(f"{self.directory}: no .metadata (not a torch_dist Megatron checkpoint)")
        self._reader = FileSystemReader(str(self.directory))
        try:
            self.metadata = self._reader.read_metadata()
        except Exception as err:  # a garbled pickle raises any of several types; name the file
            raise CheckpointError(
                f"{self.directory / '.metadata'}: unreadable ({_first_line(err)})"
            ) from None
        self._reader.set_up_storage_reader(self.metadata, True)
        self._check_files()

    def _check_files(self) -> None:
        """Every shard file the metadata names exists and holds the bytes it places there."""
        needed: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, size in sorted(needed.items()):
            path = self.directory / name
            if not path.is_file():
                raise CheckpointError(f"{path}: missing (the checkpoint's .metadata places tensors in it)")
            if path.stat().st_size < size:
                raise CheckpointError(
                    f"{path}: truncated: {path.stat().st_size} bytes, the checkpoint's .metadata "
                    f"places tensor data up to byte {size}"
                )

    def keys(self) -> list[str]:
        """Keys of the stored tensors (objects such as RNG states and extra states excluded)."""
        return [
            k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
        ]

    def _tensor(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise KeyError(f"{self.directory}: no tensor {key!r} in the checkpoint")
        return md

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensor(key).size)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensor(key).properties.dtype

    def read(
        self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], *, pad_rows: bool = False
    ) -> torch.Tensor:
        md = self._tensor(key)
        shape = tuple(md.size)
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise ValueError(f"{self.directory}: {key!r} has {len(shape)} dims, region {offsets}+{sizes}")
        stored = list(sizes)
        for dim, (start, size, full) in enumerate(zip(offsets, sizes, shape)):
            if start < 0 or (start + size > full and not (pad_rows and dim == 0)):
                raise ValueError(
                    f"{self.directory}: region {tuple(offsets)}+{tuple(sizes)} lies outside {key!r} {shape}"
                )
            stored[dim] = max(0, min(size, full - start))
        out = torch.zeros(sizes, dtype=md.properties.dtype)
        if math.prod(stored) == 0:
            return out
        target = out[tuple(slice(0, s) for s in stored)]
        items = create_read_items_for_chunk_list(
            key, md, [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(stored))]
        )
        planner = _IntoTensor(target)
        try:
            self._reader.read_data(LoadPlan(items), planner).wait()
        except Exception as err:  # bytes that do not unpickle (an overwritten shard): name the files
            bad = self._unloadable_files(items, target)
            raise CheckpointError(
                f"{', '.join(bad)}: cannot read {key!r}: its stored bytes do not load "
                f"({type(err).__name__}); the file{' is' if len(bad) == 1 else 's are'} damaged"
            ) from None
        if planner.filled != target.numel():
            raise ValueError(
                f"{self.directory}: the stored chunks of {key!r} cover {planner.filled} of the "
                f"{target.numel()} elements of region {tuple(offsets)}+{tuple(stored)}"
            )
        return out

    def _unloadable_files(self, items: list[ReadItem], target: torch.Tensor) -> list[str]:
        """Which of the files holding ``items`` fail to load on their own (all of them if none does)."""
        by_file: dict[str, list[ReadItem]] = {}
        for item in items:
            by_file.setdefault(self.metadata.storage_data[item.storage_index].relative_path, []).append(item)
        bad = []
        for name, group in sorted(by_file.items()):
            try:
                self._reader.read_data(LoadPlan(group), _IntoTensor(target)).wait()
            except Exception:  # this file is one that does not load: what we are looking for
                bad.append(str(self.directory / name))
        return bad or [str(self.directory / name) for name in sorted(by_file)]


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
