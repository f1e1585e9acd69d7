"""A model-only Megatron distributed checkpoint written one tensor at a time, from lazily read shards.

Contract: ``save_model_checkpoint(root, step=, ctx=, chunks=, shards=)`` (collective) writes
``root/step_<step>`` and then ``root/latest`` as ``rltrain.megatron.checkpoint.save_checkpoint`` does
for a model without optimizer state: the same sharded state dict (model, RNG ``ShardedObject``),
the same ``common.pt`` (``meta``, ``scheduler``) and ``metadata.json`` (torch_dist, version 1), the
same PyTorch DCP ``.metadata``; ``load_checkpoint`` loads it at any layout. But ``chunks`` may sit
on the meta device: each tensor is produced by ``shards.materialize`` inside the storage writer,
written, and dropped before the next one is read, so a rank's memory stays about one conversion
unit (``megatron_bridge.live.LazyShards``), not its whole model shard.

How: Megatron's torch_dist strategy turns the sharded state dict into DCP objects and plans the
save from metadata alone (shapes, offsets, dtypes: meta tensors suffice). Its writer
(``FileSystemWriterAsync.prepare_write_data``) then resolves *every* tensor up front and hands the
list to forked writer processes; that is the one step replaced here. ``_StreamingWriter`` plans
its file without resolving anything, and its save function resolves each item through the planner
(``_MaterializingPlanner.resolve_data`` → ``shards.materialize``) right before ``_write_item`` and
drops it after. Tensor items are sorted by conversion unit so that each HF unit is read once. Each
rank writes one ``__<rank>_0.distcp`` file (Megatron's default writer makes two, one per thread;
loaders take file names and offsets from ``.metadata``). A write error on any rank is carried in
the write results and raised on every rank by Megatron's finalize step, as with its own writer.

This module imports ``megatron.core`` (its DCP strategy classes); it is imported only on conversion
ranks. The directory protocol (temporary directory, rename, ``latest``) repeats the few lines of
``save_checkpoint``, whose signature has no way to pass a save strategy.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_plan
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.api import _wrap_exception
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, SerializationFormat, _write_item
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from megatron_bridge.live import LazyShards


class _MaterializingPlanner(MCoreSavePlanner):
    """Megatron's save planner whose tensors come from ``shards`` when resolved (one at a time)."""

    def __init__(self, shards: LazyShards) -> None:
        # The arguments Megatron's strategy passes (keep_only_main_replica=True).
        super().__init__(dedup_replicated_tensors=False, flatten_state_dict=False)
        self.shards = shards

    def placeholder(self, item: WriteItem) -> torch.Tensor:
        """The (meta) tensor the state dict holds for ``item``."""
        return super().resolve_data(item)

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        if write_item.type == WriteItemType.BYTE_IO:
            return data
        return self.shards.materialize(data)


class _StreamingWriter(FileSystemWriterAsync):
    """Megatron's DCP file writer, minus the up-front resolution: items are resolved while writing."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path, thread_count=1)
        self._planner: _MaterializingPlanner | None = None
        self._results: Any = None

    def prepare_write_data(self, plan: SavePlan, planner: _MaterializingPlanner) -> None:
        self._planner = planner
        if not plan.items:
            self.write_buckets = []
            return
        blobs = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        tensors = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        tensors.sort(key=lambda item: planner.shards.unit_order(planner.placeholder(item)))
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        self.write_buckets = [(os.path.join(self.checkpoint_dir, name), name, (blobs, tensors))]

    def get_save_function_and_args(self) -> tuple[Any, Any, list]:
        if not self.write_buckets:
            return None, None, []
        return self._write, None, []

    def _write(self) -> None:
        path, storage_key, (blobs, tensors) = self.write_buckets[0]
        transforms = [self.transforms] if hasattr(self, "transforms") else []
        results = []
        try:
            with open(path, "wb") as stream:
                for item in blobs + tensors:
                    data = self._planner.resolve_data(item)
                    results.append(
                        _write_item(
                            *transforms,
                            stream,
                            data,
                            item,
                            storage_key,
                            serialization_format=SerializationFormat.TORCH_SAVE,
                        )
                    )
                    del data
                os.fsync(stream.fileno())
        except Exception as err:
            # Not swallowed: Megatron's finalize step gathers the results and raises on every rank
            # (raising here would leave the other ranks waiting in the barrier that follows).
            self._results = _wrap_exception(err)
            return
        self._results = results

    def retrieve_write_results(self) -> Any:
        if not self.write_buckets:
            return []
        if self._results is None:
            return _wrap_exception(RuntimeError(f"{self.checkpoint_dir}: the streamed write never ran"))
        return self._results


class _StreamedTorchDistStrategy(TorchDistSaveShardedStrategy):
    """Megatron's torch_dist save (same backend, version, planner and format) with the streaming writer."""

    def __init__(self, shards: LazyShards) -> None:
        super().__init__("torch_dist", 1)
        self.shards = shards

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> Any:
        by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        pyt_state_dict = mcore_to_pyt_state_dict(by_key, False)
        writer = _StreamingWriter(checkpoint_dir)
        planned, *_ = save_state_dict_async_plan(
            pyt_state_dict, writer, None, 0, planner=_MaterializingPlanner(self.shards)
        )
        return self._get_save_and_finalize_callbacks(writer, planned)


def save_model_checkpoint(
    root: str | Path, *, step: int, ctx: Any, chunks: list[torch.nn.Module], shards: LazyShards
) -> Path:
    """Write ``root/step_<step>`` (model only) from ``shards``, then point ``latest`` at it (collective)."""
    from rltrain.megatron import checkpoint as ckpt

    root = Path(root)
    name = f"step_{step}"
    tmp, final = root / f"{ckpt._TMP_PREFIX}{name}", root / name
    if ctx.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    state = ckpt._sharded_state(ctx, chunks, None, loading=False)
    state["scheduler"] = None
    state["meta"] = {"step": step, "layout": ckpt._layout(ctx), "num_chunks": len(chunks), "optimizer": False}
    dist_checkpointing.save(state, str(tmp), sharded_strategy=_StreamedTorchDistStrategy(shards))
    dist.barrier()
    if ctx.rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker = root / f"{ckpt._TMP_PREFIX}{ckpt.LATEST}"
        marker.write_text(name)
        os.replace(marker, root / ckpt.LATEST)
    dist.barrier()
    return final
