"""A save strategy that produces each tensor only when it is written: checkpoints of models on ``meta``.

Contract: ``StreamedSaveStrategy(source, order=None)`` is a Megatron ``sharded_strategy`` for
``rltrain.megatron.checkpoint.save_checkpoint``. The model chunks may sit on the meta device: for
each stored tensor chunk the writer calls ``source(region, placeholder)`` right before writing it
and drops the result right after, so a rank holds one produced tensor at a time (plus whatever the
source caches), not its model shard. ``region`` names the chunk in checkpoint coordinates (Megatron
key, global offsets and sizes, global shape); ``placeholder`` is the (meta) view of the parameter
the model's state dict holds there. ``order(region, placeholder)`` sorts the tensor writes (a
source that reads whole units sorts by unit, to read each once); ``progress=True`` shows a bar of
this rank's writes. The result is the trainer's own
format: same backend (torch_dist, version 1), planner, metadata and file naming rules, loadable at
any layout by ``load_checkpoint``.

How: Megatron's torch_dist strategy turns the sharded state dict into DCP objects and plans the
save from metadata alone (shapes, offsets, dtypes: meta tensors suffice). Its writer
(``FileSystemWriterAsync.prepare_write_data``) then resolves *every* tensor up front and hands the
list to writer processes; that is the one step replaced here. ``_StreamingWriter`` plans its file
without resolving anything, and resolves each item through the planner (``_ProducingPlanner``)
right before ``_write_item``. Each rank writes one ``__<rank>_0.distcp`` file (loaders take file
names and offsets from ``.metadata``). A write error on any rank is carried in the write results and
raised on every rank by Megatron's finalize step, as with its own writer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
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


@dataclass(frozen=True)
class Region:
    """One stored tensor chunk in checkpoint coordinates."""

    key: str
    """Megatron's sharded key (layout independent)."""
    offsets: tuple[int, ...]
    """Offsets in the global tensor (prepended layer / expert axes included)."""
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]


Source = Callable[[Region, torch.Tensor], torch.Tensor]


def _region(item: WriteItem) -> Region:
    return Region(
        key=item.index.fqn,
        offsets=tuple(item.index.offset),
        sizes=tuple(item.tensor_data.chunk.sizes),
        global_shape=tuple(item.tensor_data.size),
    )


class _ProducingPlanner(MCoreSavePlanner):
    """Megatron's save planner whose tensors come from ``source`` when resolved (one at a time)."""

    def __init__(self, source: Source) -> None:
        # The arguments Megatron's strategy passes (keep_only_main_replica=True).
        super().__init__(dedup_replicated_tensors=False, flatten_state_dict=False)
        self.source = source

    def placeholder(self, item: WriteItem) -> torch.Tensor:
        """The (meta) tensor the state dict holds for ``item``."""
        return super().resolve_data(item)

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        if write_item.type == WriteItemType.BYTE_IO:
            return data
        produced = self.source(_region(write_item), data)
        if tuple(produced.shape) != tuple(data.shape) or produced.dtype != data.dtype:
            raise ValueError(
                f"{write_item.index.fqn} at {tuple(write_item.index.offset)}: produced "
                f"{tuple(produced.shape)} {produced.dtype}, the checkpoint expects {tuple(data.shape)} {data.dtype}"
            )
        return produced


class _StreamingWriter(FileSystemWriterAsync):
    """Megatron's DCP file writer, minus the up-front resolution: items are resolved while writing."""

    def __init__(
        self, path: str | os.PathLike, order: Callable[[Region, torch.Tensor], Any] | None, progress: bool
    ) -> None:
        super().__init__(path, thread_count=1)
        self._order, self._progress = order, progress
        self._planner: _ProducingPlanner | None = None
        self._results: Any = None

    def prepare_write_data(self, plan: SavePlan, planner: _ProducingPlanner) -> None:
        self._planner = planner
        if not plan.items:
            self.write_buckets = []
            return
        blobs = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        tensors = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        if self._order is not None:
            tensors.sort(key=lambda item: self._order(_region(item), planner.placeholder(item)))
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
        items = blobs + tensors
        if self._progress:
            from tqdm import tqdm

            items = tqdm(items, desc="write Megatron checkpoint", unit="tensor")
        try:
            with open(path, "wb") as stream:
                for item in items:
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


class StreamedSaveStrategy(TorchDistSaveShardedStrategy):
    """Megatron's torch_dist save (same backend, version, planner and format) with the streaming writer."""

    def __init__(
        self,
        source: Source,
        order: Callable[[Region, torch.Tensor], Any] | None = None,
        *,
        progress: bool = False,
    ) -> None:
        super().__init__("torch_dist", 1)
        self.source, self.order, self.progress = source, order, progress

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> Any:
        by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        pyt_state_dict = mcore_to_pyt_state_dict(by_key, False)
        writer = _StreamingWriter(checkpoint_dir, self.order, self.progress)
        planned, *_ = save_state_dict_async_plan(
            pyt_state_dict, writer, None, 0, planner=_ProducingPlanner(self.source)
        )
        return self._get_save_and_finalize_callbacks(writer, planned)
