"""Region reads from a torch DCP checkpoint directory (no process group, no Megatron).

The checkpoint is written by torch's own ``dcp.save`` in this process; each region read is compared
with slicing the tensor that was saved. Multi-chunk tensors written by several Megatron ranks are
read back in tests/dist/bridge (TP=2 checkpoints converted at TP=1).
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_bridge.convert import reshard_source
from megatron_bridge.dcp_io import DistCheckpointReader
from megatron_bridge.errors import CheckpointError


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    gen = torch.Generator().manual_seed(0)
    state = {
        "decoder.layers.mlp.linear_fc1.weight": torch.randn(3, 8, 5, generator=gen),
        "embedding.word_embeddings.weight": torch.randn(6, 4, generator=gen),
    }
    path = tmp_path_factory.mktemp("dcp")
    dcp.save({k: v.clone() for k, v in state.items()}, checkpoint_id=str(path), no_dist=True)
    return path, state


def test_regions_equal_slices_of_the_saved_tensor(saved):
    path, state = saved
    reader = DistCheckpointReader(path)
    key = "decoder.layers.mlp.linear_fc1.weight"
    assert sorted(reader.keys()) == sorted(state)
    assert reader.shape(key) == (3, 8, 5) and reader.dtype(key) == torch.float32
    assert torch.equal(reader.read(key, (0, 0, 0), (3, 8, 5)), state[key])
    assert torch.equal(reader.read(key, (1, 2, 1), (2, 4, 3)), state[key][1:3, 2:6, 1:4])


def test_rows_past_the_stored_vocab_are_zeros_only_when_asked(saved):
    path, state = saved
    reader = DistCheckpointReader(path)
    key = "embedding.word_embeddings.weight"
    padded = reader.read(key, (4, 0), (4, 4), pad_rows=True)
    assert torch.equal(padded[:2], state[key][4:]) and torch.equal(padded[2:], torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"region \(4, 0\)\+\(4, 4\) lies outside 'embedding"):
        reader.read(key, (4, 0), (4, 4))
    with pytest.raises(KeyError, match=r"no tensor 'output_layer\.weight'"):
        reader.read("output_layer.weight", (0, 0), (1, 4))


def test_reshard_source_pads_the_vocab_and_rejects_other_shape_changes(saved):
    path, state = saved
    source = reshard_source(DistCheckpointReader(path))
    key = "embedding.word_embeddings.weight"
    # A target layout whose vocab is padded to 8 rows: rank 1 of TP=2 holds rows 4..7.
    region = SimpleNamespace(key=key, offsets=(4, 0), sizes=(4, 4), global_shape=(8, 4))
    out = source(region, torch.empty(4, 4, device="meta"))
    assert torch.equal(out[:2], state[key][4:]) and not out[2:].any()
    fc1 = "decoder.layers.mlp.linear_fc1.weight"
    region = SimpleNamespace(key=fc1, offsets=(0, 0, 0), sizes=(1, 8, 5), global_shape=(4, 8, 5))
    with pytest.raises(ValueError, match=r"'decoder.layers.mlp.linear_fc1.weight' is stored as \(3, 8, 5\)"):
        source(region, torch.empty(1, 8, 5, device="meta"))


@pytest.fixture
def damaged(saved, tmp_path):
    """A copy of the saved checkpoint, and its one shard file."""
    path, _ = saved
    copy = tmp_path / "step"
    shutil.copytree(path, copy)
    (shard,) = copy.glob("*.distcp")
    return copy, shard


def test_a_truncated_or_missing_shard_is_named_when_the_reader_opens(damaged):
    path, shard = damaged
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(
        CheckpointError,
        match=rf"^{shard}: truncated: {size - 10} bytes, the checkpoint's \.metadata places tensor data up to byte {size}",
    ):
        DistCheckpointReader(path)
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"^{shard}: missing"):
        DistCheckpointReader(path)


def test_garbled_metadata_is_named(damaged):
    path, _ = damaged
    raw = bytearray((path / ".metadata").read_bytes())
    raw[: len(raw) // 2] = bytes(len(raw) // 2)
    (path / ".metadata").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"^{path / '.metadata'}: unreadable \("):
        DistCheckpointReader(path)


def test_an_overwritten_shard_names_the_file_and_the_tensor_when_read(damaged):
    path, shard = damaged
    reader = DistCheckpointReader(path)
    shard.write_bytes(bytes(shard.stat().st_size))  # same size, zeros: only reading finds it
    key = "embedding.word_embeddings.weight"
    with pytest.raises(
        CheckpointError, match=rf"^{shard}: cannot read '{key}': its stored bytes do not load"
    ):
        reader.read(key, (0, 0), (6, 4))
