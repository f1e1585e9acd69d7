"""Where each canonical tensor lives in a TP × PP × EP layout, and its slice on one rank.

Contract (pure torch, no Megatron):
- ``RankPosition`` is one rank's coordinates; ``stage_layers`` is Megatron's PP split (even or uneven).
- ``holds(bridge, pos, canonical)`` says whether the rank's model chunk has that parameter
  (embedding on the first stage, final norm and output layer on the last, experts on their EP rank).
- ``shard``/``unshard`` apply the tensor's mapping with the TP (or expert-TP) rank and size.
- ``split_state``/``merge_states`` turn a canonical state dict into per-rank chunk states (chunk
  spelling, see ``naming.ChunkNaming``) and back; they drive the reshard tests and simulations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from megatron_bridge.bridge import Bridge
from megatron_bridge.layout import chunk_layers
from megatron_bridge.naming import ChunkNaming


@dataclass(frozen=True)
class RankPosition:
    """Coordinates of one rank. ``etp_*`` default to the dense TP values (expert-TP = TP)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int | None = None
    etp_size: int | None = None
    first_stage_layers: int | None = None
    """Decoder layers on the first PP stage (``num_layers_in_first_pipeline_stage``); None: even."""
    last_stage_layers: int | None = None
    """Decoder layers on the last PP stage (``num_layers_in_last_pipeline_stage``); None: even."""

    def expert_tp(self) -> tuple[int, int]:
        size = self.tp_size if self.etp_size is None else self.etp_size
        rank = self.tp_rank if self.etp_rank is None else self.etp_rank
        return rank, size


def all_positions(
    *, tp: int = 1, pp: int = 1, ep: int = 1, first: int | None = None, last: int | None = None
) -> list[RankPosition]:
    """Every (tp, pp, ep) coordinate with expert-TP = TP (the layout the tests use); ``first``/``last``:
    decoder layers on the first/last PP stage (None: an even split)."""
    return [
        RankPosition(
            tp_rank=t,
            tp_size=tp,
            pp_rank=p,
            pp_size=pp,
            ep_rank=e,
            ep_size=ep,
            first_stage_layers=first,
            last_stage_layers=last,
        )
        for p in range(pp)
        for e in range(ep)
        for t in range(tp)
    ]


def stage_layers(
    num_layers: int, *, pp_rank: int, pp_size: int, first: int | None = None, last: int | None = None
) -> range:
    """Global decoder layers of pipeline stage ``pp_rank`` (Megatron's split: even, or uneven with
    ``first``/``last`` layers on the first/last stage)."""
    return chunk_layers(num_layers, pp_rank=pp_rank, pp=pp_size, first=first, last=last)


def _layers_of(bridge: Bridge, pos: RankPosition) -> range:
    return stage_layers(
        bridge.dims.num_layers,
        pp_rank=pos.pp_rank,
        pp_size=pos.pp_size,
        first=pos.first_stage_layers,
        last=pos.last_stage_layers,
    )


def chunk_naming(
    bridge: Bridge, pos: RankPosition, *, te_spec: bool = False, grouped_gemm: bool = False
) -> ChunkNaming:
    dims = bridge.dims
    if dims.num_experts % pos.ep_size:
        raise ValueError(
            f"num_experts={dims.num_experts} is not divisible by expert-parallel size {pos.ep_size}"
        )
    local_experts = dims.num_experts // pos.ep_size
    return ChunkNaming(
        layer_offset=_layers_of(bridge, pos).start,
        expert_offset=pos.ep_rank * local_experts,
        num_local_experts=local_experts,
        te_spec=te_spec,
        grouped_gemm=grouped_gemm,
        moe=dims.num_experts > 0,
    )


def holds(bridge: Bridge, pos: RankPosition, canonical: str) -> bool:
    """Whether the model chunk of ``pos`` has canonical parameter ``canonical``."""
    unit, _ = bridge.unit_of_megatron(canonical)
    first, last = pos.pp_rank == 0, pos.pp_rank == pos.pp_size - 1
    if canonical.startswith("embedding."):
        return first
    if canonical.startswith("output_layer."):
        return last and not (unit.tied and first)
    if canonical.startswith("mtp."):
        # Megatron-Core builds every MTP layer on the last stage
        return last and (not unit.is_expert or chunk_naming(bridge, pos).owns_expert(canonical))
    if canonical.startswith("decoder.layers."):
        layer = int(canonical.split(".")[2])
        if layer not in _layers_of(bridge, pos):
            return False
        if unit.is_expert:
            return chunk_naming(bridge, pos).owns_expert(canonical)
        return True
    return last  # final norm


def stage_copy(module: torch.nn.Module, canonical: str) -> bool:
    """Whether ``canonical`` is the embedding copy that a pipeline stage with multi-token-prediction
    layers holds beside the first stage's (Megatron keeps the two equal): loaded like it, never
    exported from there."""
    while hasattr(module, "module"):
        module = module.module
    return canonical == "embedding.word_embeddings.weight" and not getattr(module, "pre_process", True)


def tp_coords(bridge: Bridge, canonical: str, pos: RankPosition) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel group that splits ``canonical``."""
    unit, _ = bridge.unit_of_megatron(canonical)
    return pos.expert_tp() if unit.is_expert else (pos.tp_rank, pos.tp_size)


def shard(bridge: Bridge, canonical: str, full: torch.Tensor, pos: RankPosition) -> torch.Tensor:
    rank, size = tp_coords(bridge, canonical, pos)
    return bridge.mapping_for_megatron(canonical).shard(full, rank=rank, size=size)


def unshard(bridge: Bridge, canonical: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The canonical tensor from its TP shards in rank order."""
    return bridge.mapping_for_megatron(canonical).unshard(shards)


def split_state(
    bridge: Bridge,
    canonical: Mapping[str, torch.Tensor],
    pos: RankPosition,
    *,
    te_spec: bool = False,
    grouped_gemm: bool = False,
) -> dict[str, torch.Tensor]:
    """The chunk state dict (chunk spelling) that rank ``pos`` holds of a canonical model."""
    naming = chunk_naming(bridge, pos, te_spec=te_spec, grouped_gemm=grouped_gemm)
    out: dict[str, torch.Tensor] = {}
    for name in bridge.megatron_names(include_tied_output=True):
        if not holds(bridge, pos, name):
            continue
        unit, _ = bridge.unit_of_megatron(name)
        source = "embedding.word_embeddings.weight" if unit.tied else name
        out[naming.from_canonical(name)] = shard(bridge, name, canonical[source], pos).clone()
    return out


def merge_states(
    bridge: Bridge,
    states: Mapping[RankPosition, Mapping[str, torch.Tensor]],
    *,
    te_spec: bool = False,
    grouped_gemm: bool = False,
) -> dict[str, torch.Tensor]:
    """Canonical full tensors from every rank's chunk state (inverse of ``split_state``)."""
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for pos, state in states.items():
        naming = chunk_naming(bridge, pos, te_spec=te_spec, grouped_gemm=grouped_gemm)
        for local, tensor in state.items():
            name = naming.to_canonical(local)
            if bridge.unit_of_megatron(name)[0].tied:
                continue
            rank, _ = tp_coords(bridge, name, pos)
            shards.setdefault(name, {})[rank] = tensor
    return {
        name: unshard(bridge, name, [by_rank[r] for r in sorted(by_rank)]) for name, by_rank in shards.items()
    }
