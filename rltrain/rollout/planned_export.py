"""Planner-driven weight export: an engine rank's HF stream built with ``planner.plan_weight_sync`` and
``planner.assemble``, every planned slice fetched point-to-point from the trainer rank that owns it.

Contract (torch.distributed only; collective over the trainer's ranks, like
``megatron_bridge.live.export_hf_weights``, which stays the reference it is tested against):
- ``PlannedExport(chunks, ctx, bridge)`` (collective; build once per model, reuse every sync) reads
  the trainer layout off ``ctx`` and ``bridge`` (TP, PP, EP, expert-TP, Megatron's padded vocab),
  every exported HF tensor's shape, dtype and planner layout (``bridge_layouts``), and which ranks
  hold which Megatron parameters. A shard is served by its DP replica 0 (expert-DP replica 0 for
  experts), found by parameter name, so uneven or virtual pipeline stages need no special case.
- ``stream(engine, engine_rank, dst=...)`` (collective generator: every rank iterates to the end)
  yields on ``dst`` the full-shaped HF tensors that rank ``engine_rank`` of an engine laid out as
  ``engine`` reads, in export order, under the names vLLM's loader accepts. The regions the plan
  gives that rank are filled; the rest is left uninitialized (vLLM's loader on that rank narrows it
  away). Only those regions travel: each owner sends its region of its *local piece* (its Megatron
  shard unfused into HF names, in HF coordinates, by the bridge's own ``to_hf`` at the shard's
  head and vocab counts), ``dst`` receives it. No rank holds more than one unit's pieces at a time.
  Regions travel and are assembled on ``megatron_bridge.live.comm_device()`` (the current CUDA
  device under NCCL, else the CPU), whatever device the parameters are on (offloaded or not).
  For ``EngineLayout(tp=1)`` the stream equals ``export_hf_weights(dst=...)`` bit for bit.
- ``rank_regions(engine, dst=...)``: per tensor, every engine rank's planned regions (the values
  only), for engines whose workers each take their own part (``RolloutEngine.load_rank_regions``).
- ``shard_stream(engine, engine_rank, dst=...)``: the same tensors cut to that rank's region, i.e.
  its local shard (checksums against the engine's per-worker weight readback).
- ``plan(engine)`` returns ``{engine_rank: [SliceCopy]}`` (what each rank receives; tests, reports).
Models whose HF tensors are themselves fused (``FusedGatedMLP``, ``GroupedExperts``) raise
``NotImplementedError`` at construction (see ``bridge_layouts``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from rltrain.rollout.bridge_layouts import layouts_from_bridge
from rltrain.rollout.planner import (
    EngineLayout,
    SliceCopy,
    TrainerLayout,
    assemble,
    plan_weight_sync,
    trainer_range,
)

NamedTensor = tuple[str, torch.Tensor]
RankRegions = dict[int, list[tuple[tuple[slice, ...], torch.Tensor]]]
"""``{engine_rank: [(region in full HF coordinates, its values)]}`` of one HF tensor."""


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


class PlannedExport:
    """Slice-granular export of one trainer model's weights to engine ranks (see the module docstring)."""

    def __init__(self, chunks: list[torch.nn.Module], ctx: Any, bridge: Any) -> None:
        from megatron_bridge.live import chunk_namings, comm_device, hf_plan

        self.ctx, self.bridge = ctx, bridge
        self.device = comm_device()
        """Where regions travel and are assembled (CUDA under NCCL, else CPU; ``comm_device``)."""
        self.params: dict[str, torch.Tensor] = {}
        for chunk, naming in zip(chunks, chunk_namings(chunks, ctx, bridge)):
            for local, param in _unwrap(chunk).named_parameters():
                self.params[naming.to_canonical(local)] = param
        exported = hf_plan(chunks, ctx, bridge)
        self.shapes = {name: shape for name, shape, _ in exported}
        self.dtypes = {name: dtype for name, _, dtype in exported}
        self.layouts = {t.hf_name: t for t in layouts_from_bridge(bridge, self.shapes)}
        dims = bridge.dims
        self.trainer = TrainerLayout(
            tp=ctx.tp_size,
            pp=ctx.pp_size,
            ep=ctx.ep_size,
            etp=ctx.etp_size,
            num_layers=dims.num_layers,
            num_experts=dims.num_experts,
            vocab_pad_multiple=dims.padded_vocab_size // ctx.tp_size,
        )
        mine = {
            "rank": ctx.rank,
            "tp": ctx.tp_rank,
            "replica": ctx.dp_rank,
            "expert_replica": getattr(ctx, "expert_dp_rank", 0),
            "names": set(self.params),
        }
        ranks: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(ranks, mine)
        self._ranks = ranks
        self._owners: dict[tuple[str, int], int] = {}
        self._plans: dict[EngineLayout, dict[int, list[SliceCopy]]] = {}
        self._cached_unit: Any = None
        self._pieces: dict[str, torch.Tensor] = {}

    def plan(self, engine: EngineLayout) -> dict[int, list[SliceCopy]]:
        """``{engine_rank: copies}`` for an engine laid out as ``engine`` (cached)."""
        if engine not in self._plans:
            self._plans[engine] = plan_weight_sync(list(self.layouts.values()), self.trainer, engine)
        return self._plans[engine]

    def stream(self, engine: EngineLayout, engine_rank: int, *, dst: int) -> Iterator[NamedTensor]:
        """Yield engine rank ``engine_rank``'s HF tensors on global rank ``dst`` (collective)."""
        copies = self.plan(engine)[engine_rank]
        me = self.ctx.rank
        try:
            if me == dst:
                yield from assemble(copies, self.shapes, self._fetch)
                return
            for copy in copies:
                if self._owner(copy) == me:
                    dist.send(self._piece(copy.hf_name)[copy.src].contiguous().to(self.device), dst)
        finally:
            self._cached_unit, self._pieces = None, {}

    def rank_regions(
        self, engine: EngineLayout, *, dst: int
    ) -> Iterator[tuple[str, tuple[int, ...], RankRegions]]:
        """Per HF tensor (export order), on ``dst``: its full shape and ``{engine_rank: [(dst slices,
        region)]}``, every
        planned region of every engine rank, each moved once from its owner (collective). What a
        multi-worker engine hands each worker: its own regions, not whole tensors."""
        plans = self.plan(engine)
        by_name: dict[str, list[tuple[int, SliceCopy]]] = {}
        for engine_rank, copies in plans.items():
            for copy in copies:
                by_name.setdefault(copy.hf_name, []).append((engine_rank, copy))
        me = self.ctx.rank
        try:
            for name in [n for n in self.shapes if n in by_name]:
                regions: RankRegions = {}
                for engine_rank, copy in by_name[name]:
                    owner = self._owner(copy)
                    if me == dst:
                        region = self._fetch(copy)
                        region = region.clone() if owner == me else region  # the piece cache moves on
                        regions.setdefault(engine_rank, []).append((copy.dst, region))
                    elif owner == me:
                        dist.send(self._piece(name)[copy.src].contiguous().to(self.device), dst)
                if me == dst:
                    yield name, self.shapes[name], regions
        finally:
            self._cached_unit, self._pieces = None, {}

    def shard_stream(self, engine: EngineLayout, engine_rank: int, *, dst: int) -> Iterator[NamedTensor]:
        """Like ``stream``, but each tensor cut to the region engine rank ``engine_rank`` reads: its
        local shard, as vLLM's loader narrows it there (what its weight readback reports)."""
        boxes: dict[str, list[slice]] = {}
        for copy in self.plan(engine)[engine_rank]:
            box = boxes.setdefault(copy.hf_name, list(copy.dst))
            for d, piece in enumerate(copy.dst):
                box[d] = slice(min(box[d].start, piece.start), max(box[d].stop, piece.stop))
        for name, full in self.stream(engine, engine_rank, dst=dst):
            yield name, full[tuple(boxes[name])].contiguous()

    @torch.no_grad()
    def _fetch(self, copy: SliceCopy) -> torch.Tensor:
        owner = self._owner(copy)
        if owner == self.ctx.rank:
            return self._piece(copy.hf_name)[copy.src].to(self.device)
        shape = tuple(s.stop - s.start for s in copy.src)
        region = torch.empty(shape, dtype=self.dtypes[copy.hf_name], device=self.device)
        dist.recv(region, owner)
        return region

    def _owner(self, copy: SliceCopy) -> int:
        """Global rank serving ``copy.source``'s piece: replica 0 with that (expert-)TP rank and the
        tensor's Megatron parameters."""
        key = (copy.hf_name, copy.source.tp)
        if key not in self._owners:
            unit = self.bridge.unit_of_hf(copy.hf_name)
            replica = "expert_replica" if unit.is_expert else "replica"
            found = [
                r["rank"]
                for r in self._ranks
                if r[replica] == 0 and r["tp"] == copy.source.tp and set(unit.megatron_names) <= r["names"]
            ]
            if len(found) != 1:
                raise KeyError(
                    f"{copy.hf_name}: {len(found)} ranks hold Megatron {list(unit.megatron_names)} at "
                    f"tp rank {copy.source.tp} (replica 0), expected one: {found}"
                )
            self._owners[key] = found[0]
        return self._owners[key]

    @torch.no_grad()
    def _piece(self, hf_name: str) -> torch.Tensor:
        """This rank's piece of ``hf_name`` in HF coordinates (its unit converted once, then cached)."""
        unit = self.bridge.unit_of_hf(hf_name)
        if unit is not self._cached_unit:
            self._cached_unit, self._pieces = None, {}
            local = [self.params[name].detach() for name in unit.megatron_names]
            pieces = unit.mapping.to_hf(local, self._local_dims(hf_name))
            self._pieces = dict(zip(unit.hf_names, pieces))
            self._cached_unit = unit
        return self._pieces[hf_name]

    def _local_dims(self, hf_name: str) -> Any:
        """The bridge's dims as one TP shard sees them: its heads, its KV groups, its vocab rows."""
        dims, tp = self.bridge.dims, self.ctx.tp_size
        rows = dims.vocab_size
        layout = self.layouts[hf_name]
        if layout.split == "vocab":
            lo, hi = trainer_range(layout, self.trainer, self.ctx.tp_rank)  # type: ignore[misc]
            rows = hi - lo
        return replace(
            dims,
            num_attention_heads=dims.num_attention_heads // tp,
            num_query_groups=dims.num_query_groups // tp,
            vocab_size=rows,
        )
