"""Streamed reading and writing of HF safetensors checkpoints, one tensor at a time.

Contract:
- ``HFCheckpointReader(dir)`` opens ``model.safetensors.index.json`` (sharded) or the directory's
  ``*.safetensors`` files, parses only their headers, and reads a tensor (or a block of dim-0 rows)
  with plain positioned reads into a fresh tensor: no mmap, so resident memory stays about one
  tensor, whatever the checkpoint size. A file that is not safetensors, or is shorter than its
  header says, or an index naming a missing shard, raises ``errors.CheckpointError`` naming it.
- ``SafetensorsWriter(dir, plan)`` writes a checkpoint whose tensor names, shapes and dtypes are
  known up front (``plan``): headers are written first, each tensor goes to its offset when it
  arrives (any order), shards are cut at ``max_shard_bytes`` and an index json written when there
  is more than one. ``close()`` fails naming any planned tensor never written; files appear under
  their final names only then.
- ``copy_hf_aux_files`` copies config, tokenizer and generation-config files.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_bridge.errors import CheckpointError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
AUX_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Absolute byte offset of the tensor's data in ``file``."""

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors a safetensors file holds; raises ``CheckpointError`` naming ``path`` for a file that
    is not one (too short, a header that is not JSON or not a tensor table) or is truncated (its
    header places data past the end of the file)."""
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            size = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
            raw = f.read(size) if size is not None and size <= file_size - 8 else b""
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read it ({err.strerror or err})") from None
    if size is None:
        raise CheckpointError(f"{path}: not a safetensors file ({file_size} bytes, no 8-byte header length)")
    if size > file_size - 8:
        raise CheckpointError(
            f"{path}: not a safetensors file (header length {size} > the file's {file_size} bytes)"
        )
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"{path}: not a safetensors file (its {size}-byte header is not JSON: {err})"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not a table of tensors)")
    header.pop("__metadata__", None)
    out = {}
    data_end = 0
    for name, meta in header.items():
        try:
            dtype, shape, (begin, end) = (
                meta["dtype"],
                tuple(int(n) for n in meta["shape"]),
                meta["data_offsets"],
            )
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(
                f"{path}: tensor {name!r} has a malformed header entry {str(meta)[:200]}"
            ) from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        info = TensorInfo(path, DTYPES[dtype], shape, 8 + size + begin)
        if info.nbytes != end - begin:
            raise CheckpointError(
                f"{path}: tensor {name!r} header size {end - begin} != shape×dtype {info.nbytes}"
            )
        out[name] = info
        data_end = max(data_end, end)
    if 8 + size + data_end > file_size:
        raise CheckpointError(
            f"{path}: truncated: {file_size} bytes, its header places tensor data up to byte {8 + size + data_end}"
        )
    return out


def _index_files(index: Path) -> list[str]:
    """The shard files an HF index names; raises ``CheckpointError`` naming the index or a missing shard."""
    try:
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{index}: not an HF index (no readable weight_map: {err})") from None
    for name in files:
        if not (index.parent / name).is_file():
            raise CheckpointError(f"{index} lists {name}, which is missing from {index.parent}")
    return files


class HFCheckpointReader:
    """Tensor index over the safetensors files of an HF checkpoint directory."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.is_file():
            paths = [self.directory / f for f in _index_files(index)]
        else:
            paths = sorted(self.directory.glob("*.safetensors"))
        if not paths:
            raise FileNotFoundError(f"no *.safetensors (or {INDEX}) in {self.directory}")
        self.tensors: dict[str, TensorInfo] = {}
        for path in paths:
            for name, info in read_header(path).items():
                if name in self.tensors:
                    raise ValueError(f"tensor {name!r} is in both {self.tensors[name].file} and {path}")
                self.tensors[name] = info

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise KeyError(f"tensor {name!r} is not in the checkpoint {self.directory}")
        return self.tensors[name]

    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.tensors.values())

    def get(self, name: str) -> torch.Tensor:
        info = self.info(name)
        return self.get_rows(name, 0, info.shape[0] if info.shape else 1)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of dim 0 (a contiguous byte range), read from disk alone."""
        info = self.info(name)
        if not info.shape:
            out = torch.empty((), dtype=info.dtype)
            row_bytes, shape = info.nbytes, ()
        else:
            if not 0 <= start <= stop <= info.shape[0]:
                raise IndexError(f"{name}: rows {start}:{stop} out of {info.shape[0]}")
            row_bytes = _numel(info.shape[1:]) * _itemsize(info.dtype)
            shape = (stop - start, *info.shape[1:])
            out = torch.empty(shape, dtype=info.dtype)
        buffer = out.reshape(-1).view(torch.uint8).numpy()
        with open(info.file, "rb") as f:
            f.seek(info.begin + start * row_bytes)
            if f.readinto(memoryview(buffer)) != buffer.nbytes:
                raise CheckpointError(f"{info.file}: truncated: short read of tensor {name!r}")
        return out


class SafetensorsWriter:
    """Writes planned tensors into (sharded) safetensors files, each tensor as it arrives."""

    def __init__(
        self,
        directory: str | Path,
        plan: list[tuple[str, tuple[int, ...], torch.dtype]],
        *,
        max_shard_bytes: int = 5 * 1024**3,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
        size = 0
        for entry in plan:
            nbytes = _numel(entry[1]) * _itemsize(entry[2])
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(entry)
            size += nbytes
        n = len(shards)
        self.files = (
            ["model.safetensors"]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        # name -> (shard, absolute offset, nbytes, shape, dtype)
        self._where: dict[str, tuple[int, int, int, tuple[int, ...], torch.dtype]] = {}
        self._handles = []
        for i, entries in enumerate(shards):
            self._handles.append(self._open_shard(i, entries))
        self._pending = set(self._where)

    def _open_shard(self, index: int, entries: list[tuple[str, tuple[int, ...], torch.dtype]]):
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype in entries:
            nbytes = _numel(shape) * _itemsize(dtype)
            header[name] = {
                "dtype": DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        begin = 0
        for name, shape, dtype in entries:
            nbytes = _numel(shape) * _itemsize(dtype)
            self._where[name] = (index, 8 + len(raw) + begin, nbytes, tuple(shape), dtype)
            begin += nbytes
        handle = open(self.directory / (self.files[index] + ".partial"), "wb")  # noqa: SIM115
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(8 + len(raw) + offset)
        return handle

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._where:
            raise KeyError(f"tensor {name!r} is not in the write plan of {self.directory}")
        if name not in self._pending:
            raise ValueError(f"tensor {name!r} was written twice to {self.directory}")
        shard, offset, _, shape, dtype = self._where[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(
                f"tensor {name!r}: got {tuple(tensor.shape)} {tensor.dtype}, planned {shape} {dtype}"
            )
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        handle = self._handles[shard]
        handle.seek(offset)
        handle.write(memoryview(data))
        self._pending.discard(name)

    def close(self) -> None:
        for handle in self._handles:
            handle.close()
        if self._pending:
            raise ValueError(f"{self.directory}: planned tensors never written: {sorted(self._pending)[:20]}")
        for name in self.files:
            (self.directory / (name + ".partial")).rename(self.directory / name)
        if len(self.files) > 1:
            weight_map = {name: self.files[where[0]] for name, where in self._where.items()}
            total = sum(where[2] for where in self._where.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def copy_hf_aux_files(source: str | Path, dest: str | Path) -> list[str]:
    """Copy config, tokenizer and generation-config files present in ``source`` into ``dest`` (created
    if missing); returns their names."""
    copied = []
    Path(dest).mkdir(parents=True, exist_ok=True)
    for name in AUX_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, Path(dest) / name)
            copied.append(name)
    return copied
