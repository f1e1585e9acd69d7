"""An HF-named, read-only view of a Megatron distributed checkpoint, read one conversion unit at a time.

Contract (torch only): ``MegatronCheckpointView(step_dir, hf_config, locations)`` offers the reader
interface of ``hf_io.HFCheckpointReader`` (``directory``, ``names``, ``info``, ``total_bytes``,
``get``) over a Megatron checkpoint, so that everything written against an HF source (loading,
the streamed Megatron writer, comparisons) takes a Megatron one too. ``locations`` maps each
canonical Megatron parameter to ``(checkpoint key, index along the key's prepended axes)``
(the trainer's checkpoint code tells it for a model of the same family, at any
layout); the full parameter is the stored tensor ``key[index]``. ``get(name)`` reads the unit that
holds HF tensor ``name`` (its Megatron tensors, from whatever stored chunks cover them), converts it
with the bridge and keeps only that unit, so memory stays about one unit. The vocabulary padding is
the stored one (embedding rows), whatever TP wrote the checkpoint. Names and shapes are known
without reading data. Missing locations or keys fail naming them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_bridge.bridge import Bridge, Unit
from megatron_bridge.dcp_io import DistCheckpointReader
from megatron_bridge.errors import CheckpointError
from megatron_bridge.hf_io import TensorInfo
from megatron_bridge.registry import get_family

_EMBED = "embedding.word_embeddings.weight"


class MegatronCheckpointView:
    """HF tensors of a Megatron checkpoint, converted from its stored tensors on demand."""

    def __init__(
        self, step_dir: str | Path, hf_config: Any, locations: dict[str, tuple[str, tuple[int, ...]]]
    ) -> None:
        self.directory = Path(step_dir)
        self.stored = DistCheckpointReader(step_dir)
        self.locations = locations
        base = Bridge.from_hf_config(hf_config)
        missing = [n for n in base.megatron_names() if n not in locations]
        if missing:
            raise KeyError(f"{self.directory}: no checkpoint location for Megatron parameters {missing[:20]}")
        absent = sorted({locations[n][0] for n in base.megatron_names()} - set(self.stored.keys()))
        if absent:
            raise CheckpointError(
                f"{self.directory}: the checkpoint has no tensors {absent[:20]} that the model of its HF "
                "config needs (was it saved from another model?)"
            )
        rows = self.stored.shape(locations[_EMBED][0])[len(locations[_EMBED][1])]
        self.bridge = Bridge(get_family(base.dims.model_type), base.dims.with_padded_vocab(rows))
        self._infos = {name: info for unit in self._units() for name, info in self._unit_infos(unit)}
        self._cached_unit: Unit | None = None
        self._cached: dict[str, torch.Tensor] = {}

    def _units(self) -> list[Unit]:
        return [u for u in self.bridge.units if not u.tied]

    def _region(self, canonical: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        """(key, offsets, sizes) of the full parameter ``canonical`` in its stored tensor."""
        key, index = self.locations[canonical]
        shape = self.stored.shape(key)
        if len(index) > len(shape):
            raise ValueError(f"{self.directory}: {key!r} {shape} has fewer axes than index {index}")
        offsets = (*index, *[0] * (len(shape) - len(index)))
        return key, offsets, (*[1] * len(index), *shape[len(index) :])

    def _unit_infos(self, unit: Unit) -> list[tuple[str, TensorInfo]]:
        metas = []
        for canonical in unit.megatron_names:
            key, _, sizes = self._region(canonical)
            shape = sizes[len(self.locations[canonical][1]) :]
            metas.append(torch.empty(shape, dtype=self.stored.dtype(key), device="meta"))
        out = self.bridge.to_hf(unit, metas)
        return [
            (name, TensorInfo(self.directory, t.dtype, tuple(t.shape), -1))
            for name, t in zip(unit.hf_names, out)
        ]

    # ---- the HFCheckpointReader interface ----------------------------------------------------
    def names(self) -> list[str]:
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        if name not in self._infos:
            raise KeyError(f"tensor {name!r} is not in the checkpoint {self.directory}")
        return self._infos[name]

    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self._infos.values())

    def read_megatron(self, canonical: str) -> torch.Tensor:
        """The full (unsharded, vocab-padded) Megatron parameter ``canonical``."""
        key, offsets, sizes = self._region(canonical)
        tensor = self.stored.read(key, offsets, sizes)
        return tensor.reshape(sizes[len(self.locations[canonical][1]) :])

    def get(self, name: str) -> torch.Tensor:
        self.info(name)  # raises naming an unknown tensor
        unit = self.bridge.unit_of_hf(name)
        if unit is not self._cached_unit:
            self._cached_unit, self._cached = None, {}  # free the previous unit before reading the next
            megatron = [self.read_megatron(n) for n in unit.megatron_names]
            self._cached = dict(zip(unit.hf_names, self.bridge.to_hf(unit, megatron)))
            self._cached_unit = unit
        return self._cached[name]
