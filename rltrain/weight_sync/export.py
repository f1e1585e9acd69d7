"""The trainer side of weight sync: an engine layout's HF tensors built from this trainer's Megatron
shards with the reshard plan (``megatron_bridge.reshard``), each planned slice sent once,
point-to-point, by the trainer rank that owns it.

Contract (torch.distributed only; collective over the trainer's ranks):
- ``PlannedExport(chunks, ctx, bridge, converters=...)`` (collective; build once per model, reuse
  every sync) reads the trainer layout off ``ctx`` and ``bridge`` (TP, PP, EP, expert-TP, Megatron's
  padded vocab),
  every exported HF tensor's shape, dtype and planner layout (``reshard_layouts.layouts_from_bridge``), and
  which ranks hold which Megatron parameters. A shard is served by its DP replica 0 (expert-DP
  replica 0 for experts), found by parameter name, so uneven or virtual pipeline stages need no
  special case. Stacked experts (``GroupedExperts``: GPT-OSS) are served by each EP rank for its
  block of experts (its local piece stacks its own experts). A family whose HF tensor fuses gate
  and up (``FusedGatedMLP``) is refused here, naming the tensor.
- ``converters``: the model's converters (``rltrain.megatron.converters``); at every sync each
  one's ``export(chunk, tensors)`` transforms the chunk's mapped tensors (merged adapters under the
  base names, renames) before the plan reads them; none: the parameters themselves.
- ``regions(engine, dst=...)`` (collective generator: every rank iterates to the end) first checks
  every rank's parameters and refuses non-finite ones (:class:`~rltrain.errors.NonFiniteWeightsError`
  on every rank, naming the first such parameter, before anything is sent: NaN never reaches an
  engine), then yields on
  ``dst``, per HF tensor in export order, a ``TensorRegions``: every engine rank's planned regions,
  each moved once from its owner. Owners send their region of their *local piece* (their Megatron
  shard unfused into HF names, in HF coordinates, by the bridge's own ``to_hf`` at the shard's head
  and vocab counts); no rank holds more than one unit's pieces at a time. A region this rank owns
  is a view of its piece, not a copy (every engine load copies what it keeps). Regions travel and
  are assembled on ``megatron_bridge.live.comm_device()`` (the current CUDA device under NCCL, else
  the CPU), whatever device the parameters are on (offloaded or not).
- ``stream(engine, engine_rank, dst=...)``: the full-shaped tensors that rank reads (its regions
  filled, the rest uninitialized); for ``EngineLayout(tp=1)`` they equal
  ``megatron_bridge.live.export_hf_weights(dst=...)`` bit for bit.
- ``plan(engine)`` returns ``{engine_rank: [SliceCopy]}`` (what each rank receives; tests, reports).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from megatron_bridge.reshard import (
    EngineLayout,
    SliceCopy,
    TrainerLayout,
    plan_weight_sync,
    trainer_range,
)
from megatron_bridge.reshard_layouts import layouts_from_bridge
from megatron_bridge.vllm_names import grouped_order
from rltrain.errors import NonFiniteWeightsError
from rltrain.tensor_checks import first_non_finite, global_max_abs
from rltrain.weight_sync.shard_to_shard import Bucket, Schedule, Slot, slots_in_order
from rltrain.weight_sync.types import NamedTensor, TensorRegions


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


class PlannedExport:
    """Slice-granular export of one trainer model's weights to engine ranks (see the module docstring)."""

    def __init__(
        self, chunks: list[torch.nn.Module], ctx: Any, bridge: Any, *, converters: Sequence[Any] = ()
    ) -> None:
        from megatron_bridge.live import chunk_namings, comm_device, hf_plan

        # The engine serves the main model: multi-token-prediction layers stay with the trainer.
        bridge = bridge.main_model()
        self.ctx, self.bridge = ctx, bridge
        self.device = comm_device()
        """Where regions travel and are assembled (CUDA under NCCL, else CPU; ``comm_device``)."""
        self._chunks = [
            (_unwrap(chunk), naming) for chunk, naming in zip(chunks, chunk_namings(chunks, ctx, bridge))
        ]
        self._converters = tuple(converters)
        """Model converters (``rltrain.megatron.converters``) whose ``export`` transforms what is sent."""
        self.params: dict[str, torch.Tensor] = self._exported_params()
        # Export order with vLLM's fused modules (q/k/v, DeepSeek's q_a/kv_a down projections, ...)
        # adjacent: an engine in other processes loads group-aligned buckets (``iter_buckets``).
        plan = hf_plan(chunks, ctx, bridge, params=self.params if self._converters else None)
        exported = grouped_order((name, (shape, dtype)) for name, shape, dtype in plan)
        self.shapes = {name: shape for name, (shape, _) in exported}
        self.dtypes = {name: dtype for name, (_, dtype) in exported}
        self.layouts = {t.hf_name: t for t in layouts_from_bridge(bridge, self.shapes)}
        dims = bridge.dims
        self.trainer = TrainerLayout(
            tp=ctx.tp_size,
            pp=ctx.pp_size,
            ep=ctx.ep_size,
            etp=ctx.etp_size,
            num_layers=dims.num_layers,
            vpp=ctx.vpp_size or 1,
            first_stage_layers=ctx.parallel.num_layers_in_first_pipeline_stage,
            last_stage_layers=ctx.parallel.num_layers_in_last_pipeline_stage,
            num_experts=dims.num_experts,
            vocab_pad_multiple=dims.padded_vocab_size // ctx.tp_size,
        )
        mine = {
            "rank": ctx.rank,
            "tp": ctx.tp_rank,
            "etp": getattr(ctx, "etp_rank", ctx.tp_rank),
            # Under context parallelism the CP ranks of a replica hold the same weights: serve from one.
            "replica": getattr(ctx, "dp_cp_rank", ctx.dp_rank),
            "expert_replica": getattr(ctx, "expert_dp_rank", 0),
            "names": set(self.params),
        }
        ranks: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(ranks, mine)
        self._ranks = ranks
        self._owners: dict[tuple[str, int], int] = {}
        self._plans: dict[EngineLayout, dict[int, list[SliceCopy]]] = {}
        self._schedules: dict[tuple[EngineLayout, int], Schedule] = {}
        self._cached_unit: Any = None
        self._pieces: dict[str, torch.Tensor] = {}

    def _exported_params(self) -> dict[str, torch.Tensor]:
        """This rank's tensors to export by canonical Megatron name: the parameters (and persistent
        buffers) the bridge maps, as the converters' ``export`` transforms them (none: themselves)."""
        from megatron_bridge.live import mapped_tensors
        from megatron_bridge.sharding import stage_copy

        params: dict[str, torch.Tensor] = {}
        known = set(self.bridge.megatron_names(include_tied_output=True))
        for module, naming in self._chunks:
            tensors = dict(mapped_tensors(module))
            with torch.no_grad():
                for converter in self._converters:
                    tensors = converter.export(module, tensors)
            for local, tensor in tensors.items():
                canonical = naming.to_canonical(local)
                # not sent: multi-token-prediction layers (the bridge's main model has none) and the
                # embedding copy of their stage
                if canonical in known and not stage_copy(module, canonical):
                    params[canonical] = tensor
        return params

    def plan(self, engine: EngineLayout) -> dict[int, list[SliceCopy]]:
        """``{engine_rank: copies}`` for an engine laid out as ``engine`` (cached)."""
        if engine not in self._plans:
            self._plans[engine] = plan_weight_sync(list(self.layouts.values()), self.trainer, engine)
        return self._plans[engine]

    def regions(self, engine: EngineLayout, *, dst: int) -> Iterator[TensorRegions]:
        """Per HF tensor (export order), on ``dst``: every engine rank's planned regions (collective)."""
        by_name: dict[str, list[tuple[int, SliceCopy]]] = {}
        for engine_rank, copies in self.plan(engine).items():
            for copy in copies:
                by_name.setdefault(copy.hf_name, []).append((engine_rank, copy))
        me = self.ctx.rank
        if self._converters:  # what they send (merged adapters, ...) follows the trained weights
            self.params = self._exported_params()
        self.check_finite()
        try:
            for name in [n for n in self.shapes if n in by_name]:
                update = TensorRegions(name, self.shapes[name], {})
                for engine_rank, copy in by_name[name]:
                    if me == dst:
                        update.regions.setdefault(engine_rank, []).append((copy.dst, self._fetch(copy)))
                        senders = update.senders.setdefault(engine_rank, [])
                        if self._owner(copy) not in senders:
                            senders.append(self._owner(copy))
                    elif self._owner(copy) == me:
                        dist.send(self._piece(name)[copy.src].contiguous().to(self.device), dst)
                if me == dst:
                    yield update
        finally:
            self._cached_unit, self._pieces = None, {}

    def schedule(self, engine: EngineLayout, *, bucket_bytes: int) -> Schedule:
        """The shard-to-shard messages of a sync into engines laid out as ``engine`` (cached; the
        same on every rank): the planned slices in export order, each from its owner, in buckets
        of about ``bucket_bytes`` that never split a fused module."""
        key = (engine, bucket_bytes)
        if key not in self._schedules:
            slots = (
                (
                    Slot(copy.hf_name, worker, owner, copy.src, copy.dst),
                    self.shapes[copy.hf_name],
                    self.dtypes[copy.hf_name],
                )
                for worker, copy, owner in slots_in_order(self.plan(engine), list(self.shapes), self._owner)
            )
            self._schedules[key] = Schedule.build(
                list(slots), bucket_bytes=bucket_bytes, num_trainer_ranks=self.ctx.world_size
            )
        return self._schedules[key]

    def serve(self, schedule: Schedule) -> Iterator[tuple[Bucket, Iterator[torch.Tensor]]]:
        """Per bucket of ``schedule``: the values of this rank's slots in it, in order (views of
        its pieces, produced as they are consumed). Collective: first checks every rank's
        weights are finite (``check_finite``)."""
        if self._converters:  # what they send (merged adapters, ...) follows the trained weights
            self.params = self._exported_params()
        self.check_finite()
        try:
            for bucket in schedule.buckets:
                mine = bucket.slots.get(self.ctx.rank, [])
                yield bucket, (self._piece(s.name)[s.src] for s in mine)
        finally:
            self._cached_unit, self._pieces = None, {}

    def check_finite(self) -> None:
        """Raise :class:`NonFiniteWeightsError` on every rank when a rank's parameter holds a NaN or
        an infinity, naming the first (collective)."""
        named = list(self.params.items())
        if math.isfinite(global_max_abs(named, device=self.device)):
            return
        found = first_non_finite(named)
        assert found is not None, "global_max_abs saw a non-finite value that no rank holds"
        rank, name = found
        raise NonFiniteWeightsError(
            f"weight sync refused: parameter {name} (trainer rank {rank}) holds NaN or infinite values; "
            "the engines keep their weights"
        )

    def stream(self, engine: EngineLayout, engine_rank: int, *, dst: int) -> Iterator[NamedTensor]:
        """Engine rank ``engine_rank``'s full-shaped HF tensors, on ``dst`` (collective)."""
        for update in self.regions(engine, dst=dst):
            if engine_rank in update.regions:
                yield update.name, update.full(engine_rank)

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
        key = (copy.hf_name, copy.source.tp, copy.source.ep)
        if key not in self._owners:
            unit = self.bridge.unit_of_hf(copy.hf_name)
            replica = "expert_replica" if unit.is_expert else "replica"
            names = self._source_names(copy.hf_name, copy.source.ep)
            found = [
                r["rank"]
                for r in self._ranks
                if r[replica] == 0
                and r["etp" if unit.is_expert else "tp"] == copy.source.tp
                and set(names) <= r["names"]
            ]
            if len(found) != 1:
                raise KeyError(
                    f"{copy.hf_name}: {len(found)} ranks hold Megatron {names} at "
                    f"tp rank {copy.source.tp} (replica 0), expected one: {found}"
                )
            self._owners[key] = found[0]
        return self._owners[key]

    def _source_names(self, hf_name: str, ep_rank: int) -> list[str]:
        """The Megatron parameters behind the piece of ``hf_name`` that EP rank ``ep_rank`` serves:
        the unit's, or for stacked experts those of that rank's block of experts (expert order)."""
        unit = self.bridge.unit_of_hf(hf_name)
        names = list(unit.megatron_names)
        if self.layouts[hf_name].stacked:
            per = len(names) // self.trainer.ep
            names = names[ep_rank * per : (ep_rank + 1) * per]
        return names

    @torch.no_grad()
    def _piece(self, hf_name: str) -> torch.Tensor:
        """This rank's piece of ``hf_name`` in HF coordinates (its unit converted once, then cached)."""
        unit = self.bridge.unit_of_hf(hf_name)
        if unit is not self._cached_unit:
            self._cached_unit, self._pieces = None, {}
            names = unit.megatron_names
            if self.layouts[hf_name].stacked:  # this rank's block of experts, stacked in expert order
                names = [n for n in names if n in self.params]
            local = [self.params[name].detach() for name in names]
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
