"""Typed mappings between HF checkpoint tensors and Megatron parameters.

Contract: a mapping relates one *unit* of HF tensors to one unit of canonical Megatron tensors
(see ``naming``). Each mapping

- converts full tensors both ways (``to_megatron``/``to_hf``), bit-exactly: only reshapes, slices,
  concatenations and zero padding, never arithmetic or dtype changes;
- knows how Megatron splits its tensor over tensor parallelism (``tp_dim``; ``shard``/``unshard``),
  including the packing order of fused tensors (QKV grouped by KV head, gate/up halves per rank);
- says whether the tensor is an expert tensor (split over EP, TP'd with the expert-TP size).

Units are one Megatron tensor for every mapping except ``GroupedExperts`` (one stacked HF tensor ↔
one Megatron tensor per expert). Shapes and dims come from ``ModelDims``; nothing here imports
Megatron.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_bridge.dims import ModelDims
from megatron_bridge.naming import fill, num_wildcards

Tensor = torch.Tensor
LayerKind = Literal["all", "dense", "moe"]
QueryKind = Literal["any", "latent", "direct"]


def _check_split(size: int, parts: int, what: str) -> None:
    if parts < 1 or size % parts:
        raise ValueError(f"{what}: size {size} is not divisible by {parts} parallel ranks")


@dataclass(frozen=True)
class Mapping:
    """A 1:1 rename with a TP split dimension (``tp_dim=None``: replicated on every TP rank).

    ``layers``: which decoder layers have the tensor in a model mixing dense and MoE layers
    (``"dense"``: only layers with a dense MLP, ``"moe"``: only MoE layers, ``"all"``: every layer).
    ``query``: multi-latent attention's query rows, ``"latent"`` only in a model with a query latent
    (``q_lora_rank`` set), ``"direct"`` only in one projecting queries directly (DeepSeek-V2-Lite);
    ``"any"``: every model (``ModelDims.mla_query``).
    ``switch``: the row exists only in models whose HF config sets this boolean key true
    (GLM-4.5's optional per-head q/k norms, ``use_qk_norm``; ``ModelDims.switches``); None: always.
    """

    megatron: str
    hf: str
    tp_dim: int | None = None
    layers: LayerKind = "all"
    query: QueryKind = "any"
    switch: str | None = None

    is_expert = False

    def hf_patterns(self) -> tuple[str, ...]:
        return (self.hf,)

    def megatron_names(self, values: tuple[int, ...], dims: ModelDims) -> list[str]:
        return [fill(self.megatron, values)]

    def hf_names(self, values: tuple[int, ...]) -> list[str]:
        return [fill(p, values) for p in self.hf_patterns()]

    def to_megatron(self, hf: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        return [hf[0]]

    def to_hf(self, megatron: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        return [megatron[0]]

    def hf_split_dim(self, ndim: int) -> int | None:
        """The dim of the HF tensor (``ndim`` dims) along which TP ranks hold contiguous blocks
        (``tp_dim`` unless the HF tensor is Megatron's transposed)."""
        return self.tp_dim

    def shard(self, full: Tensor, *, rank: int, size: int) -> Tensor:
        """The slice of canonical tensor ``full`` that TP rank ``rank`` of ``size`` holds."""
        if self.tp_dim is None or size == 1:
            return full
        _check_split(full.shape[self.tp_dim], size, self.megatron)
        return full.chunk(size, dim=self.tp_dim)[rank]

    def unshard(self, shards: Sequence[Tensor]) -> Tensor:
        """Inverse of ``shard``: the canonical tensor from every TP rank's slice, in rank order."""
        if self.tp_dim is None or len(shards) == 1:
            return shards[0]
        return torch.cat(list(shards), dim=self.tp_dim)


@dataclass(frozen=True)
class Replicated(Mapping):
    """Same tensor on every TP rank (norm weights, routers, row-parallel biases)."""


@dataclass(frozen=True)
class ColumnParallel(Mapping):
    """Output features split over TP (``tp_dim=0``)."""

    tp_dim: int | None = 0


@dataclass(frozen=True)
class RowParallel(Mapping):
    """Input features split over TP (``tp_dim=1``)."""

    tp_dim: int | None = 1


@dataclass(frozen=True)
class VocabParallel(Mapping):
    """Embedding / output layer: rows split over TP after zero-padding the vocab to Megatron's size."""

    tp_dim: int | None = 0

    def to_megatron(self, hf: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        weight = hf[0]
        if weight.shape[0] != dims.vocab_size:
            raise ValueError(f"{self.hf}: {weight.shape[0]} rows, config vocab_size is {dims.vocab_size}")
        pad = dims.padded_vocab_size - weight.shape[0]
        if pad == 0:
            return [weight]
        return [torch.cat([weight, weight.new_zeros((pad, *weight.shape[1:]))], dim=0)]

    def to_hf(self, megatron: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        return [megatron[0][: dims.vocab_size]]


@dataclass(frozen=True)
class QKV(Mapping):
    """Separate q/k/v projections ↔ Megatron's fused ``linear_qkv`` (weight or bias).

    Megatron packs per KV group g: ``[q heads of g, k_g, v_g]``, each head ``head_dim`` rows, and
    splits over TP by whole groups, so a TP shard is a contiguous block of rows.
    """

    hf: str = ""
    k: str = ""
    v: str = ""
    tp_dim: int | None = 0

    def hf_patterns(self) -> tuple[str, ...]:
        return (self.hf, self.k, self.v)

    def to_megatron(self, hf: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        q, k, v = hf
        groups, d = dims.num_query_groups, dims.head_dim
        per_group = dims.num_attention_heads // groups
        tail = q.shape[1:]
        fused = torch.cat(
            [
                q.reshape(groups, per_group * d, *tail),
                k.reshape(groups, d, *tail),
                v.reshape(groups, d, *tail),
            ],
            dim=1,
        )
        return [fused.reshape(groups * (per_group + 2) * d, *tail)]

    def to_hf(self, megatron: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        groups, d = dims.num_query_groups, dims.head_dim
        per_group = dims.num_attention_heads // groups
        fused = megatron[0]
        tail = fused.shape[1:]
        grouped = fused.reshape(groups, (per_group + 2) * d, *tail)
        q, k, v = grouped.split([per_group * d, d, d], dim=1)
        return [
            q.reshape(groups * per_group * d, *tail),
            k.reshape(groups * d, *tail),
            v.reshape(groups * d, *tail),
        ]


@dataclass(frozen=True)
class GatedMLP(Mapping):
    """Separate gate/up projections ↔ Megatron's ``linear_fc1`` = ``[gate; up]``.

    Each TP rank holds ``[gate_r; up_r]`` (its slice of both halves), not a contiguous block.
    """

    hf: str = ""
    up: str = ""
    tp_dim: int | None = 0

    def hf_patterns(self) -> tuple[str, ...]:
        return (self.hf, self.up)

    def to_megatron(self, hf: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        return [torch.cat([hf[0], hf[1]], dim=0)]

    def to_hf(self, megatron: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        return list(megatron[0].chunk(2, dim=0))

    def shard(self, full: Tensor, *, rank: int, size: int) -> Tensor:
        if size == 1:
            return full
        gate, up = full.chunk(2, dim=0)
        _check_split(gate.shape[0], size, self.megatron)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)

    def unshard(self, shards: Sequence[Tensor]) -> Tensor:
        if len(shards) == 1:
            return shards[0]
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


@dataclass(frozen=True)
class FusedGatedMLP(GatedMLP):
    """HF already stores ``gate_up_proj = [gate; up]`` (Phi-3, transformers-5 fused experts)."""

    def hf_patterns(self) -> tuple[str, ...]:
        return (self.hf,)

    def to_megatron(self, hf: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        return [hf[0]]

    def to_hf(self, megatron: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        return [megatron[0]]


@dataclass(frozen=True)
class PerExpert:
    """An expert tensor stored per expert on both sides; wildcards are (layer, expert).

    Split over EP by whole experts and over expert-TP by ``inner``'s rule.
    """

    inner: Mapping

    is_expert = True
    layers: LayerKind = "moe"

    @property
    def megatron(self) -> str:
        return self.inner.megatron

    @property
    def tp_dim(self) -> int | None:
        return self.inner.tp_dim

    def hf_patterns(self) -> tuple[str, ...]:
        return self.inner.hf_patterns()

    def megatron_names(self, values: tuple[int, ...], dims: ModelDims) -> list[str]:
        return self.inner.megatron_names(values, dims)

    def hf_names(self, values: tuple[int, ...]) -> list[str]:
        return self.inner.hf_names(values)

    def to_megatron(self, hf: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        return self.inner.to_megatron(hf, dims)

    def to_hf(self, megatron: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        return self.inner.to_hf(megatron, dims)

    def shard(self, full: Tensor, *, rank: int, size: int) -> Tensor:
        return self.inner.shard(full, rank=rank, size=size)

    def unshard(self, shards: Sequence[Tensor]) -> Tensor:
        return self.inner.unshard(shards)


@dataclass(frozen=True)
class GroupedExperts:
    """One HF tensor stacking all experts (dim 0) ↔ one Megatron tensor per expert.

    ``inner`` describes a single expert with the HF pattern lacking the expert wildcard; the unit
    is one layer: ``num_experts`` Megatron tensors for each HF tensor.
    """

    inner: Mapping

    is_expert = True
    layers: LayerKind = "moe"

    @property
    def megatron(self) -> str:
        return self.inner.megatron

    @property
    def tp_dim(self) -> int | None:
        return self.inner.tp_dim

    def hf_patterns(self) -> tuple[str, ...]:
        return self.inner.hf_patterns()

    def megatron_names(self, values: tuple[int, ...], dims: ModelDims) -> list[str]:
        if num_wildcards(self.inner.megatron) != len(values) + 1:
            raise ValueError(f"{self.inner.megatron}: needs one more wildcard (the expert) than its HF names")
        return [fill(self.inner.megatron, (*values, e)) for e in range(dims.num_experts)]

    def hf_names(self, values: tuple[int, ...]) -> list[str]:
        return self.inner.hf_names(values)

    def to_megatron(self, hf: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        for name_pattern, t in zip(self.hf_patterns(), hf):
            if t.shape[0] != dims.num_experts:
                raise ValueError(
                    f"{name_pattern}: {t.shape[0]} stacked experts, config has {dims.num_experts}"
                )
        return [self.inner.to_megatron([t[e] for t in hf], dims)[0] for e in range(dims.num_experts)]

    def to_hf(self, megatron: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        per_expert = [self.inner.to_hf([m], dims) for m in megatron]
        return [torch.stack([p[i] for p in per_expert]) for i in range(len(per_expert[0]))]

    def shard(self, full: Tensor, *, rank: int, size: int) -> Tensor:
        return self.inner.shard(full, rank=rank, size=size)

    def unshard(self, shards: Sequence[Tensor]) -> Tensor:
        return self.inner.unshard(shards)


@dataclass(frozen=True)
class CopyOf(Mapping):
    """An HF tensor that repeats the HF tensor of another row: a multi-token-prediction layer's own
    embedding or output head (``model.layers.*.embed_tokens`` / ``shared_head.head``, ``*`` the MTP
    layer's HF index), which Megatron shares with the main model. ``megatron`` names the shared
    Megatron tensor; the bridge adds ``hf`` to that tensor's unit (``WithCopies``)."""


@dataclass(frozen=True)
class WithCopies:
    """``inner``'s unit plus HF tensors ``copies`` that must equal its first HF tensor bit for bit.

    Import refuses a copy that differs, naming it (Megatron holds one tensor for both, so a
    different copy would be lost); export writes the shared tensor under every copy's name.
    """

    inner: Mapping
    copies: tuple[str, ...]

    is_expert = False

    @property
    def megatron(self) -> str:
        return self.inner.megatron

    @property
    def layers(self) -> LayerKind:
        return self.inner.layers

    @property
    def tp_dim(self) -> int | None:
        return self.inner.tp_dim

    def hf_patterns(self) -> tuple[str, ...]:
        return (*self.inner.hf_patterns(), *self.copies)

    def megatron_names(self, values: tuple[int, ...], dims: ModelDims) -> list[str]:
        return self.inner.megatron_names(values, dims)

    def hf_names(self, values: tuple[int, ...]) -> list[str]:
        return [*self.inner.hf_names(values), *self.copies]

    def to_megatron(self, hf: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        own = len(self.inner.hf_patterns())
        shared = hf[0]
        for name, copy in zip(self.copies, hf[own:]):
            if copy.dtype != shared.dtype or copy.shape != shared.shape or not torch.equal(copy, shared):
                raise ValueError(
                    f"{name} differs from {self.inner.hf}: Megatron shares one tensor for both "
                    "(the multi-token-prediction layer's copy would be lost)"
                )
        return self.inner.to_megatron(hf[:own], dims)

    def to_hf(self, megatron: Sequence[Tensor], dims: ModelDims) -> list[Tensor]:
        out = self.inner.to_hf(megatron, dims)
        return [*out, *[out[0]] * len(self.copies)]

    def shard(self, full: Tensor, *, rank: int, size: int) -> Tensor:
        return self.inner.shard(full, rank=rank, size=size)

    def unshard(self, shards: Sequence[Tensor]) -> Tensor:
        return self.inner.unshard(shards)


AnyMapping = Mapping | PerExpert | GroupedExperts | WithCopies
