"""The reshard planner of live weight sync: which slices of which trainer shards each rollout-engine
rank needs, in vLLM's (HF) names.

Pure layout knowledge (no torch.distributed, no vLLM, no Megatron, nothing of rltrain); the trainer's
sender (``rltrain.weight_sync``) moves what it plans. Everything is in *HF coordinates*: a trainer shard
holds a region of each HF tensor (the bridge unfuses Megatron's QKV / gate-up shards into HF-named
pieces), and an engine rank needs a region of each HF tensor (the rows/columns vLLM's loader narrows
the full HF tensor to on that rank). The plan intersects the two.

Layouts:
- trainer (Megatron): dense tensors split over TP, layers over PP (uniform stages; embedding on the
  first stage, final norm and LM head on the last), experts over EP and each expert over expert-TP;
  vocab rows padded to a multiple of ``vocab_pad_multiple × tp`` and split evenly.
- engine (vLLM): dense tensors split over its TP, but whole on every rank where vLLM replicates a
  module the trainer splits (``TensorLayout.engine_replicated``); KV heads replicated when TP exceeds their number
  (rank r takes head ``r // (tp / num_kv_heads)``); vocab padded to ``vocab_pad_multiple`` then split
  evenly; experts either TP-split like dense weights (``ep == 1``) or whole, spread over the ranks
  (``ep == tp``, vLLM's ``enable_expert_parallel``).
- stacked experts (GPT-OSS's ``mlp.experts.gate_up_proj`` [experts, hidden, 2 × ffn] and its
  companions, ``TensorLayout.stacked``): dim 0 indexes every expert of the layer; the trainer holds
  its EP rank's block of rows, each split over expert-TP along ``TensorLayout.dim``; the engine reads
  all experts split over its TP along that dim, or (expert parallel) its block of whole experts,
  as vLLM's GPT-OSS loader narrows them.
Per-tensor split knowledge comes in ``TensorLayout`` (read off the bridge in
``megatron_bridge.reshard_layouts``; the minimal description the bridge's mapping
types carry: split kind, split dim, head size for KV heads, layer and expert index).
Contract: for every engine rank, the ``dst`` regions of its copies tile exactly the region it needs,
each element once (tested for TP 1/2/4/8 → 1/2/4/8, PP and EP layouts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_bridge.layout import stage_of_layer

SplitKind = Literal["replicated", "column", "row", "vocab", "kv_heads"]
_SPLIT_DIM = {"column": 0, "row": 1, "vocab": 0, "kv_heads": 0}


@dataclass(frozen=True)
class TensorLayout:
    """How one HF tensor is split (the same kind on both sides: column-parallel stays column-parallel)."""

    hf_name: str
    """HF parameter name as vLLM's loader accepts it."""
    shape: tuple[int, ...]
    """Full (unpadded) HF shape."""
    split: SplitKind
    """``column``: dim 0; ``row``: dim 1; ``vocab``: dim 0 with padding; ``kv_heads``: dim 0 by heads,
    replicated on the engine when its TP exceeds the head count; ``replicated``: not split."""
    layer: int | None = None
    """Decoder layer index; None for the embedding (first PP stage) and final norm / head (last)."""
    last_stage: bool = False
    """A non-layer tensor of the last PP stage (final norm, LM head)."""
    expert: int | None = None
    """Global expert index of an expert tensor (split over EP, and over expert-TP instead of TP)."""
    head_dim: int = 1
    """Rows per head for ``kv_heads``."""
    engine_replicated: bool = False
    """vLLM keeps the whole tensor on every engine rank although the trainer splits it
    (``megatron_bridge.vllm_names.vllm_replicates``: DeepSeek's MLA down projections)."""
    stacked: bool = False
    """Dim 0 stacks all the layer's experts (one HF tensor for every expert; ``expert`` is None)."""
    dim: int | None = None
    """The split dim when it is not the split kind's own (stacked experts: the expert's split dim + 1)."""

    @property
    def split_dim(self) -> int:
        return self.dim if self.dim is not None else _SPLIT_DIM[self.split]


@dataclass(frozen=True)
class TrainerLayout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    """Expert tensor-parallel size; None means ``tp``."""
    num_layers: int = 1
    vpp: int = 1
    """Virtual pipeline chunks per stage (interleaved schedule): stage s holds every pp-th chunk."""
    first_stage_layers: int | None = None
    """Decoder layers on the first PP stage (``num_layers_in_first_pipeline_stage``); None: even."""
    last_stage_layers: int | None = None
    """Decoder layers on the last PP stage (``num_layers_in_last_pipeline_stage``); None: even."""
    num_experts: int = 0
    vocab_pad_multiple: int = 128
    """Megatron's ``make_vocab_size_divisible_by``; the padded vocab is a multiple of it × TP."""


@dataclass(frozen=True)
class EngineLayout:
    tp: int = 1
    ep: int = 1
    """1: experts TP-split; equal to ``tp``: whole experts spread over the ranks (expert parallel)."""
    vocab_pad_multiple: int = 64


@dataclass(frozen=True)
class ShardId:
    """One trainer shard: pipeline stage, (expert-)TP rank, EP rank (0 for dense tensors)."""

    pp: int
    tp: int
    ep: int = 0


@dataclass(frozen=True)
class SliceCopy:
    """Copy ``source``'s local piece ``[src]`` into the full HF tensor ``hf_name`` at ``[dst]``."""

    hf_name: str
    source: ShardId
    src: tuple[slice, ...]
    """Region in the source shard's local piece of the HF tensor."""
    dst: tuple[slice, ...]
    """Region in full HF coordinates (what the engine rank's loader reads)."""


Range = tuple[int, int]


def _even(size: int, parts: int, index: int, padded: int | None = None) -> Range:
    per = (padded if padded is not None else size) // parts
    return min(index * per, size), min((index + 1) * per, size)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _check(t: TensorLayout, size: int, parts: int, side: str) -> None:
    if t.split != "vocab" and size % parts:
        raise ValueError(f"{t.hf_name}: dim {t.split_dim} of size {size} does not split over {side}={parts}")


def trainer_range(t: TensorLayout, trainer: TrainerLayout, tp_rank: int) -> Range | None:
    """Range along the split dim held by trainer (expert-)TP rank ``tp_rank``; None: not split."""
    if t.split == "replicated":
        return None
    parts = (trainer.etp or trainer.tp) if is_expert(t) else trainer.tp
    size = t.shape[t.split_dim]
    _check(t, size, parts, "trainer tp")
    padded = _round_up(size, trainer.vocab_pad_multiple * parts) if t.split == "vocab" else None
    return _even(size, parts, tp_rank, padded)


def engine_range(t: TensorLayout, engine: EngineLayout, rank: int) -> Range | None:
    """Range along the split dim that engine rank ``rank`` needs; None: the whole tensor."""
    if t.split == "replicated" or t.engine_replicated or (is_expert(t) and engine.ep > 1):
        return None
    size = t.shape[t.split_dim]
    if t.split == "kv_heads" and engine.tp > size // t.head_dim:
        heads = size // t.head_dim
        if engine.tp % heads:
            raise ValueError(f"{t.hf_name}: engine tp={engine.tp} is not a multiple of its {heads} KV heads")
        head = rank // (engine.tp // heads)
        return head * t.head_dim, (head + 1) * t.head_dim
    _check(t, size, engine.tp, "engine tp")
    padded = _round_up(size, engine.vocab_pad_multiple) if t.split == "vocab" else None
    if padded is not None and padded % engine.tp:
        raise ValueError(f"{t.hf_name}: padded vocab {padded} does not split over engine tp={engine.tp}")
    return _even(size, engine.tp, rank, padded)


def is_expert(t: TensorLayout) -> bool:
    """An expert tensor: one expert's, or every expert of a layer stacked."""
    return t.expert is not None or t.stacked


def _block(num_experts: int, parts: int, index: int, side: str) -> Range:
    """Experts ``[lo, hi)`` of EP rank ``index`` of ``parts`` (contiguous blocks, Megatron's and vLLM's
    default placement)."""
    if num_experts % parts:
        raise ValueError(f"num_experts={num_experts} does not split over {side} ep={parts}")
    per = num_experts // parts
    return index * per, (index + 1) * per


def _stage(t: TensorLayout, trainer: TrainerLayout) -> int:
    if t.layer is None:
        return trainer.pp - 1 if t.last_stage else 0
    return stage_of_layer(
        t.layer,
        trainer.num_layers,
        pp=trainer.pp,
        vpp=trainer.vpp,
        first=trainer.first_stage_layers,
        last=trainer.last_stage_layers,
    )


def _full(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, s) for s in shape)


def _along(shape: tuple[int, ...], dim: int, lo: int, hi: int) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) if d == dim else slice(0, s) for d, s in enumerate(shape))


def plan_tensor(t: TensorLayout, trainer: TrainerLayout, engine: EngineLayout, rank: int) -> list[SliceCopy]:
    """The copies that give engine rank ``rank`` its region of tensor ``t``."""
    if t.stacked:
        return _plan_stacked(t, trainer, engine, rank)
    stage = _stage(t, trainer)
    ep_rank = 0
    if t.expert is not None:
        if trainer.num_experts % trainer.ep:
            raise ValueError(f"num_experts={trainer.num_experts} does not split over trainer ep={trainer.ep}")
        ep_rank = t.expert // (trainer.num_experts // trainer.ep)
    need = engine_range(t, engine, rank)
    parts = (
        ((trainer.etp or trainer.tp) if t.expert is not None else trainer.tp)
        if t.split != "replicated"
        else 1
    )
    copies = []
    for tp_rank in range(parts):
        have = trainer_range(t, trainer, tp_rank)
        if have is None:  # replicated: spread the reads over the trainer's TP ranks
            holders = trainer.tp if t.expert is None else (trainer.etp or trainer.tp)
            source = ShardId(stage, rank % holders, ep_rank)
            return [SliceCopy(t.hf_name, source, _full(t.shape), _full(t.shape))]
        lo, hi = have if need is None else (max(have[0], need[0]), min(have[1], need[1]))
        if lo >= hi:
            continue
        dim = t.split_dim
        copies.append(
            SliceCopy(
                t.hf_name,
                ShardId(stage, tp_rank, ep_rank),
                src=_along(_local_shape(t.shape, dim, have), dim, lo - have[0], hi - have[0]),
                dst=_along(t.shape, dim, lo, hi),
            )
        )
    return copies


def _local_shape(shape: tuple[int, ...], dim: int, have: Range) -> tuple[int, ...]:
    return tuple(have[1] - have[0] if d == dim else s for d, s in enumerate(shape))


def _box(shape: tuple[int, ...], ranges: dict[int, Range]) -> tuple[slice, ...]:
    return tuple(slice(*ranges[d]) if d in ranges else slice(0, s) for d, s in enumerate(shape))


def _plan_stacked(
    t: TensorLayout, trainer: TrainerLayout, engine: EngineLayout, rank: int
) -> list[SliceCopy]:
    """Copies of a stacked-experts tensor for engine rank ``rank``: the trainer's EP rank ``k`` holds
    experts ``_block(E, ep, k)`` (its local piece: those rows, each (expert-)TP rank its range along
    ``split_dim``); the engine reads every expert along its TP range, or its block of whole experts."""
    num_experts = t.shape[0]
    if num_experts != trainer.num_experts:
        raise ValueError(f"{t.hf_name}: {num_experts} stacked experts, the trainer has {trainer.num_experts}")
    stage = _stage(t, trainer)
    need_experts = _block(num_experts, engine.ep, rank, "engine") if engine.ep > 1 else (0, num_experts)
    need = engine_range(t, engine, rank)
    parts = 1 if t.split == "replicated" else (trainer.etp or trainer.tp)
    copies = []
    for ep_rank in range(trainer.ep):
        have_experts = _block(num_experts, trainer.ep, ep_rank, "trainer")
        lo, hi = max(have_experts[0], need_experts[0]), min(have_experts[1], need_experts[1])
        if lo >= hi:
            continue
        rows = {0: (lo, hi)}
        local_rows = {0: (lo - have_experts[0], hi - have_experts[0])}
        local_shape = (have_experts[1] - have_experts[0], *t.shape[1:])
        for tp_rank in range(parts):
            have = trainer_range(t, trainer, tp_rank)
            if have is None:  # replicated within the expert: spread the reads over expert-TP ranks
                source = ShardId(stage, rank % (trainer.etp or trainer.tp), ep_rank)
                copies.append(
                    SliceCopy(t.hf_name, source, _box(local_shape, local_rows), _box(t.shape, rows))
                )
                break
            a, b = have if need is None else (max(have[0], need[0]), min(have[1], need[1]))
            if a >= b:
                continue
            dim = t.split_dim
            piece_shape = _local_shape(local_shape, dim, have)
            copies.append(
                SliceCopy(
                    t.hf_name,
                    ShardId(stage, tp_rank, ep_rank),
                    src=_box(piece_shape, {**local_rows, dim: (a - have[0], b - have[0])}),
                    dst=_box(t.shape, {**rows, dim: (a, b)}),
                )
            )
    return copies


def plan_weight_sync(
    tensors: list[TensorLayout], trainer: TrainerLayout, engine: EngineLayout
) -> dict[int, list[SliceCopy]]:
    """``{engine_rank: copies}`` for every engine rank, tensors in the given order."""
    if engine.ep not in (1, engine.tp):
        raise ValueError(f"engine ep={engine.ep} must be 1 or equal to engine tp={engine.tp}")
    plan: dict[int, list[SliceCopy]] = {}
    for rank in range(engine.tp):
        copies: list[SliceCopy] = []
        for t in tensors:
            if t.expert is not None and engine.ep > 1:
                if trainer.num_experts % engine.ep:
                    raise ValueError(
                        f"num_experts={trainer.num_experts} does not split over engine ep={engine.ep}"
                    )
                if t.expert // (trainer.num_experts // engine.ep) != rank:
                    continue
            copies += plan_tensor(t, trainer, engine, rank)
        plan[rank] = copies
    return plan
