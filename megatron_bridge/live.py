"""Load HF weights into live Megatron model chunks, and stream HF-named weights out of them.

Contract (torch and torch.distributed only; ``ctx`` is the caller's parallel context: anything with
its rank and size attributes — ``rank``, ``world_size``, ``tp_rank``/``tp_size``, ``dp_rank``,
``ep_rank``/``ep_size``, ``etp_rank``/``etp_size`` (expert tensor parallelism, which may differ from
TP) — and ``groups``):
- ``bridge_for_chunks`` binds the family table to the model as built (its padded vocabulary);
  ``head="score"`` for a reward model, whose ``output_layer.weight`` [1, hidden] loads the
  ``score.weight`` of an HF ``*ForSequenceClassification`` checkpoint.
- ``load_hf_weights(chunks, ctx, bridge, reader)`` (collective) fills every parameter of this rank's
  chunks from an ``HFCheckpointReader``, one unit at a time; it fails naming model parameters with
  no mapping, HF tensors never used by any rank (unexpected), missing HF tensors and mis-shaped ones.
  A score-head bridge first checks that the checkpoint has that head with one label, else raises
  ``errors.CheckpointError`` naming the directory.
- ``LazyShards(chunks, ctx, bridge, reader)`` does the same checks for chunks that may sit on the
  meta device, and reads a parameter's values (or any view of it) only when ``materialize``d,
  keeping one unit: the source of a streamed checkpoint writer.
- ``export_hf_weights(chunks, ctx, bridge, dst=0)`` (collective generator: every rank must exhaust
  it) yields ``(hf_name, full tensor)`` on global rank ``dst`` only (not from an MTP stage's embedding
  copy, ``sharding.stage_copy``), one unit at a time, in HF order;
  the TP shards travel point-to-point from the one replica that holds them (DP/expert-DP rank 0)
  to ``dst``; no rank ever holds more than one unit of full tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_bridge.bridge import Bridge, Head
from megatron_bridge.errors import CheckpointError
from megatron_bridge.hf_io import HFCheckpointReader
from megatron_bridge.naming import ChunkNaming
from megatron_bridge.registry import get_family
from megatron_bridge.sharding import stage_copy

_EMBED = "embedding.word_embeddings.weight"
NOT_MAPPED = "not_mapped_by_bridge"
"""Attribute of a parameter that is none of the HF checkpoint's (a model converter's, e.g. LoRA's)."""
_DTYPE_CODES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


def chunk_namings(chunks: list[torch.nn.Module], ctx: Any, bridge: Bridge) -> list[ChunkNaming]:
    """Per chunk: layer offset from its first layer's global ``layer_number``, expert offset from EP."""
    local_experts = bridge.dims.num_experts // ctx.ep_size if bridge.dims.num_experts else 0
    namings = []
    for chunk in chunks:
        layers = _unwrap(chunk).decoder.layers
        offset = layers[0].layer_number - 1 if len(layers) else 0
        grouped = any(".mlp.experts.linear_fc1.weight" in n for n, _ in chunk.named_parameters())
        te = any("linear_qkv.layer_norm_weight" in n for n, _ in chunk.named_parameters())
        namings.append(
            ChunkNaming(
                layer_offset=offset,
                expert_offset=ctx.ep_rank * local_experts,
                num_local_experts=local_experts,
                te_spec=te,
                grouped_gemm=grouped,
                moe=bridge.dims.num_experts > 0,
            )
        )
    return namings


def bridge_for_chunks(
    hf_config: Any, chunks: list[torch.nn.Module], ctx: Any, *, head: Head = "lm"
) -> Bridge:
    """The bridge of ``hf_config`` with the vocabulary padding of the chunks as built; ``head``: what
    their ``output_layer.weight`` is (``"score"``: a reward model's scalar head)."""
    bridge = Bridge.from_hf_config(hf_config, tp_size=ctx.tp_size, head=head)
    # A scalar head has one row: only the embedding (and an LM head) tell the padded vocabulary.
    vocab_params = (_EMBED,) if head == "score" else (_EMBED, "output_layer.weight")
    rows = [p.shape[0] for c in chunks for n, p in _unwrap(c).named_parameters() if n in vocab_params]
    if rows:
        return Bridge(
            get_family(bridge.dims.model_type),
            bridge.dims.with_padded_vocab(rows[0] * ctx.tp_size),
            head=head,
        )
    return bridge


def mapped_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s parameters and its persistent buffers (a router's ``expert_bias``, which
    DeepSeek-V3 checkpoints hold as ``e_score_correction_bias``): every tensor the bridge maps, so
    not the parameters marked ``NOT_MAPPED``."""
    yield from ((n, p) for n, p in module.named_parameters() if not getattr(p, NOT_MAPPED, False))
    persistent = set(module.state_dict(keep_vars=True))
    for name, buffer in module.named_buffers():
        if name in persistent:
            yield name, buffer


def _local_params(chunks: list[torch.nn.Module], ctx: Any, bridge: Bridge, *, copies: bool = True) -> list:
    """(canonical name, local name, parameter) of this rank's chunks (``copies=False``: no ``stage_copy``)."""
    return [
        (naming.to_canonical(local), local, param)
        for chunk, naming in zip(chunks, chunk_namings(chunks, ctx, bridge))
        for local, param in mapped_tensors(_unwrap(chunk))
        if copies or not stage_copy(chunk, naming.to_canonical(local))
    ]


def _tp_coords(bridge: Bridge, canonical: str, ctx: Any) -> tuple[int, int]:
    """(rank, size) of the group that splits ``canonical``: expert-TP for expert tensors, else TP."""
    if bridge.unit_of_megatron(canonical)[0].is_expert:
        return _etp(ctx)
    return ctx.tp_rank, ctx.tp_size


def _etp(ctx: Any) -> tuple[int, int]:
    size = getattr(ctx, "etp_size", ctx.tp_size)
    return getattr(ctx, "etp_rank", ctx.tp_rank if size == ctx.tp_size else 0), size


def _checked_params(
    chunks: list[torch.nn.Module], ctx: Any, bridge: Bridge, reader: HFCheckpointReader
) -> dict[int, list[tuple[str, str, torch.Tensor]]]:
    """This rank's parameters grouped by unit id, after checking both name sets; errors name them."""
    _check_score_head(bridge, reader)
    params = _local_params(chunks, ctx, bridge)
    for canonical, local, _ in params:
        if canonical not in bridge._by_megatron:
            raise KeyError(
                f"model parameter {local!r} (canonical {canonical!r}) has no mapping in {bridge.family.name}"
            )
    available = set(reader.names())
    missing = sorted(set(bridge.hf_names()) - available)
    unexpected = sorted(available - set(bridge.hf_names()))
    if missing or unexpected:
        raise KeyError(
            f"HF checkpoint {reader.directory}: missing tensors {missing[:20]}; unexpected tensors {unexpected[:20]}"
        )
    by_unit: dict[int, list[tuple[str, str, torch.Tensor]]] = {}
    for item in params:
        unit, _ = bridge.unit_of_megatron(item[0])
        by_unit.setdefault(id(unit), []).append(item)
    return by_unit


def _check_score_head(bridge: Bridge, reader: HFCheckpointReader) -> None:
    """A reward model needs a sequence classifier's scalar head: ``score.weight`` [1, hidden]."""
    name = bridge.score_head
    if name is None:
        return
    if name not in reader.tensors:
        heads = [n for n in reader.names() if "." not in n.removesuffix(".weight")]
        raise CheckpointError(
            f"HF checkpoint {reader.directory} has no {name}: a reward model loads a "
            f"*ForSequenceClassification checkpoint with num_labels=1 (its head tensors: {heads})"
        )
    shape, hidden = reader.info(name).shape, bridge.dims.hidden_size
    if shape != (1, hidden):
        labels = f" (num_labels={shape[0]})" if len(shape) == 2 and shape[1] == hidden else ""
        raise CheckpointError(
            f"HF checkpoint {reader.directory}: {name} has shape {list(shape)}{labels}; "
            f"a reward model needs num_labels=1, i.e. [1, {hidden}]"
        )


def _unit_shards(
    unit: Any,
    wanted: list[tuple[str, str, torch.Tensor]],
    ctx: Any,
    bridge: Bridge,
    reader: HFCheckpointReader,
) -> list[torch.Tensor]:
    """This rank's shards of ``wanted`` (canonical, local, parameter) read from ``reader`` (one unit)."""
    full = dict(zip(unit.megatron_names, bridge.to_megatron(unit, [reader.get(n) for n in unit.hf_names])))
    pieces = []
    for canonical, local, param in wanted:
        rank, size = _tp_coords(bridge, canonical, ctx)
        piece = unit.mapping.shard(full[canonical], rank=rank, size=size)
        if piece.shape != param.shape:
            raise ValueError(
                f"HF {list(unit.hf_names)} → {local!r}: shard shape {tuple(piece.shape)} != parameter {tuple(param.shape)}"
            )
        pieces.append(piece)
    return pieces


@torch.no_grad()
def load_hf_weights(
    chunks: list[torch.nn.Module],
    ctx: Any,
    bridge: Bridge,
    reader: HFCheckpointReader,
    *,
    progress: bool = False,
) -> None:
    """Copy the HF checkpoint of ``reader`` into this rank's chunks (collective for the name checks)."""
    by_unit = _checked_params(chunks, ctx, bridge, reader)
    for unit in _maybe_progress(bridge.units, progress, "load HF weights"):
        wanted = by_unit.get(id(unit))
        if not wanted:
            continue
        for (_, _, param), piece in zip(wanted, _unit_shards(unit, wanted, ctx, bridge, reader)):
            param.copy_(piece)


class LazyShards:
    """This rank's parameter shards, read from an HF checkpoint only when asked for, one unit at a time.

    ``chunks`` may live on the meta device: a parameter (or any view of it, such as the halves of a
    gated MLP weight that Megatron checkpoints separately) is recognised by its storage, and
    ``materialize(view)`` returns the same view of the real values, in the parameter's dtype. Only
    the shards of the most recently read unit are kept, so memory stays about one unit whatever
    the model size, provided the callers ask unit by unit (``unit_order`` sorts requests).
    """

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        ctx: Any,
        bridge: Bridge,
        reader: HFCheckpointReader,
        *,
        progress: bool = False,
    ) -> None:
        self.ctx, self.bridge, self.reader = ctx, bridge, reader
        self._by_unit = _checked_params(chunks, ctx, bridge, reader)
        self._bar = _progress_bar(len(self._by_unit), "write Megatron checkpoint") if progress else None
        self._order = {id(u): i for i, u in enumerate(bridge.units)}
        self._by_storage: dict[int, tuple[Any, str, torch.Tensor]] = {}
        for unit in bridge.units:
            for _, local, param in self._by_unit.get(id(unit), []):
                if not param.is_contiguous():
                    raise NotImplementedError(
                        f"parameter {local!r} is not contiguous; views of it cannot be mapped"
                    )
                self._by_storage[_storage_id(param)] = (unit, local, param)
        self._cached_unit: Any = None
        self._cached: dict[str, torch.Tensor] = {}

    def close(self) -> None:
        """Drop the cached unit and end the progress bar."""
        self._cached_unit, self._cached = None, {}
        if self._bar is not None:
            self._bar.close()

    def _owner(self, view: torch.Tensor) -> tuple[Any, str, torch.Tensor]:
        owner = self._by_storage.get(_storage_id(view))
        if owner is None:
            raise KeyError(
                f"tensor of shape {tuple(view.shape)} is not a view of any parameter of this rank's model"
            )
        return owner

    def unit_order(self, view: torch.Tensor) -> int:
        """Position of ``view``'s unit in ``bridge.units`` (sort requests by it to read each unit once)."""
        return self._order[id(self._owner(view)[0])]

    @torch.no_grad()
    def materialize(self, view: torch.Tensor) -> torch.Tensor:
        """A compact CPU tensor with the values of ``view`` (a view of a parameter of this rank)."""
        unit, local, param = self._owner(view)
        if unit is not self._cached_unit:
            self._cached_unit, self._cached = None, {}  # free the previous unit before reading the next
            wanted = self._by_unit[id(unit)]
            pieces = _unit_shards(unit, wanted, self.ctx, self.bridge, self.reader)
            self._cached = {name: _compact(piece.to(p.dtype)) for (_, name, p), piece in zip(wanted, pieces)}
            del pieces
            self._cached_unit = unit
            if self._bar is not None:
                self._bar.update()
        real = self._cached[local]
        return _compact(
            real.as_strided(view.shape, view.stride(), view.storage_offset() - param.storage_offset())
        )


def _storage_id(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` alone in its storage (a copy if it is a view into a larger one), contiguous."""
    tensor = tensor.contiguous()
    if tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes():
        return tensor
    return tensor.clone()


def _source_of(owners: list[dict], canonical: str, tp_key: str = "tp_rank") -> list[tuple[int, int]]:
    """(global rank, tp rank) of the replica-0 ranks holding ``canonical``, ordered by their rank
    ``tp_key`` in the group that splits it (``etp_rank`` for an expert tensor)."""
    found = sorted((o[tp_key], o["rank"]) for o in owners if o["replica"] == 0 and canonical in o["names"])
    return [(rank, tp) for tp, rank in found]


def export_hf_weights(
    chunks: list[torch.nn.Module], ctx: Any, bridge: Bridge, *, dst: int = 0, progress: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield full HF-named tensors on rank ``dst``; every rank must iterate to the end."""
    params = {c: p for c, _, p in _local_params(chunks, ctx, bridge, copies=False)}
    is_expert_rank_replica = getattr(ctx, "expert_dp_rank", 0)
    mine = {
        "rank": ctx.rank,
        "tp_rank": ctx.tp_rank,
        "etp_rank": _etp(ctx)[0],
        # Under context parallelism the CP ranks of a replica hold the same weights: serve from one.
        "replica": getattr(ctx, "dp_cp_rank", ctx.dp_rank),
        "expert_replica": is_expert_rank_replica,
        "names": set(params),
    }
    owners: list[dict] = [{} for _ in range(ctx.world_size)]
    dist.all_gather_object(owners, mine)
    for unit in _maybe_progress(bridge.units, progress and ctx.rank == dst, "export HF weights"):
        if unit.tied:
            continue
        tensors = []
        for canonical in unit.megatron_names:
            key = "expert_replica" if unit.is_expert else "replica"
            tp_key = "etp_rank" if unit.is_expert else "tp_rank"
            sources = _source_of([{**o, "replica": o[key]} for o in owners], canonical, tp_key)
            if not sources:
                raise KeyError(
                    f"no rank holds Megatron parameter {canonical!r} (for HF {list(unit.hf_names)})"
                )
            shards = [_transfer(params.get(canonical), src=src, dst=dst, me=ctx.rank) for src, _ in sources]
            if ctx.rank == dst:
                tensors.append(unit.mapping.unshard(shards))
        if ctx.rank == dst:
            yield from zip(unit.hf_names, bridge.to_hf(unit, tensors))


def hf_plan(chunks: list[torch.nn.Module], ctx: Any, bridge: Bridge, *, params: dict | None = None) -> list:
    """(HF name, shape, dtype) of every exported tensor, in export order (collective; shapes via meta
    tensors). ``params``: this rank's tensors to export by canonical name, if not the chunks' own."""
    params = params if params is not None else {c: p for c, _, p in _local_params(chunks, ctx, bridge)}
    local = {c: (tuple(p.shape), p.dtype) for c, p in params.items()}
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, local)
    shards = {name: value for g in gathered for name, value in g.items()}
    plan = []
    for unit in bridge.units:
        if unit.tied:
            continue
        metas = []
        for canonical in unit.megatron_names:
            shape, dtype = shards[canonical]
            _, size = _tp_coords(bridge, canonical, ctx)
            piece = torch.empty(shape, dtype=dtype, device="meta")
            metas.append(unit.mapping.unshard([piece] * size))
        plan += [(n, tuple(t.shape), t.dtype) for n, t in zip(unit.hf_names, bridge.to_hf(unit, metas))]
    return plan


def _maybe_progress(units: list, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(units, desc=desc, unit="tensor") if enabled else units


def _progress_bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="unit")


def comm_device() -> torch.device:
    """The device point-to-point weight transfers use: the current CUDA device when the default group
    runs NCCL (which moves CUDA tensors only), else the CPU (gloo). Sender and receiver derive it
    the same way, so both ends of every send/recv use the same backend."""
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _transfer(local: torch.Tensor | None, *, src: int, dst: int, me: int) -> torch.Tensor | None:
    """Move one shard from ``src`` to ``dst`` (header with shape and dtype, then the data), on
    ``comm_device()``; the result on ``dst`` is there too."""
    device = comm_device()
    if src == dst:
        return local.detach().to(device, copy=True) if me == dst else None
    if me == src:
        header = torch.zeros(10, dtype=torch.int64)
        header[0], header[1] = _DTYPE_CODES.index(local.dtype), local.dim()
        header[2 : 2 + local.dim()] = torch.tensor(local.shape)
        dist.send(header.to(device), dst)
        dist.send(local.detach().contiguous().to(device), dst)
        return None
    if me == dst:
        header = torch.empty(10, dtype=torch.int64, device=device)
        dist.recv(header, src)
        codes = header.tolist()
        shape = tuple(int(s) for s in codes[2 : 2 + codes[1]])
        out = torch.empty(shape, dtype=_DTYPE_CODES[codes[0]], device=device)
        dist.recv(out, src)
        return out
    return None
