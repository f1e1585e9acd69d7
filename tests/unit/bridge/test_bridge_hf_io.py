"""Streamed safetensors reader/writer against safetensors' own loader (bit-exact)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_bridge.errors import CheckpointError
from megatron_bridge.hf_io import HFCheckpointReader, SafetensorsWriter


def test_writer_shards_and_reader_reads_back(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(7, 5, generator=gen),
        "b": torch.randn(3, generator=gen).to(torch.bfloat16),
        "c": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "d": torch.randn(2, 2, 2, generator=gen).half(),
    }
    plan = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    writer = SafetensorsWriter(tmp_path, plan, max_shard_bytes=150)
    for name in ("d", "a", "c", "b"):  # any order
        writer.write(name, tensors[name])
    writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = {}
    for file in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(tmp_path / file))
    reader = HFCheckpointReader(tmp_path)
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t) and loaded[name].dtype == t.dtype
        assert torch.equal(reader.get(name), t)
    assert torch.equal(reader.get_rows("a", 2, 5), tensors["a"][2:5])
    assert reader.total_bytes() == sum(t.numel() * t.element_size() for t in tensors.values())


def test_reader_reads_files_written_by_safetensors(tmp_path):
    t = {"x.weight": torch.randn(4, 3), "y": torch.ones(2, dtype=torch.bfloat16)}
    save_file(t, tmp_path / "model.safetensors")
    reader = HFCheckpointReader(tmp_path)
    assert sorted(reader.names()) == ["x.weight", "y"]
    assert torch.equal(reader.get("x.weight"), t["x.weight"]) and torch.equal(reader.get("y"), t["y"])
    with pytest.raises(KeyError, match="'z'"):
        reader.get("z")


def test_writer_names_unwritten_and_misshaped_tensors(tmp_path):
    writer = SafetensorsWriter(tmp_path, [("w", (2, 2), torch.float32), ("v", (2,), torch.float32)])
    with pytest.raises(ValueError, match=r"tensor 'w': got \(3, 2\)"):
        writer.write("w", torch.zeros(3, 2))
    writer.write("w", torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"never written: \['v'\]"):
        writer.close()
    assert not (tmp_path / "model.safetensors").exists()


def _one_file_checkpoint(tmp_path):
    save_file({"x.weight": torch.randn(64, 16), "y": torch.ones(8)}, tmp_path / "model.safetensors")
    return tmp_path / "model.safetensors"


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda raw: raw[:5], r"not a safetensors file \(5 bytes, no 8-byte header length\)"),
        (
            lambda raw: raw[:8] + b"\xff" * 32 + raw[40:],
            r"not a safetensors file \(its \d+-byte header is not JSON: 'utf-8' codec can't decode",
        ),
        (lambda raw: b"\xff" * 8 + raw[8:], r"not a safetensors file \(header length \d+ > the file's"),
        (lambda raw: raw[:8] + b"[" + raw[9:], r"not a safetensors file \(its \d+-byte header is not JSON"),
        (
            lambda raw: raw[: len(raw) - 100],
            r"truncated: \d+ bytes, its header places tensor data up to byte",
        ),
    ],
    ids=["too-short", "not-utf8", "huge-header-length", "not-json", "truncated-data"],
)
def test_an_unreadable_safetensors_file_is_named_with_the_reason(tmp_path, damage, reason):
    path = _one_file_checkpoint(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError, match=rf"^{path}: {reason}"):
        HFCheckpointReader(tmp_path)


def test_an_index_naming_a_missing_shard_or_garbled_is_named(tmp_path):
    _one_file_checkpoint(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(
        json.dumps({"weight_map": {"x.weight": "model.safetensors", "y": "model-2.safetensors"}})
    )
    with pytest.raises(CheckpointError, match=rf"^{index} lists model-2.safetensors, which is missing"):
        HFCheckpointReader(tmp_path)
    index.write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"^{index}: not an HF index"):
        HFCheckpointReader(tmp_path)


def test_a_file_truncated_after_opening_names_it_on_read(tmp_path):
    path = _one_file_checkpoint(tmp_path)
    reader = HFCheckpointReader(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"^{path}: truncated: short read of tensor"):
        [reader.get(name) for name in reader.names()]
