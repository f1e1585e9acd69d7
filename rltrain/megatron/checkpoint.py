"""Atomic Megatron distributed checkpoints (model, optimizer, scheduler, RNG) that reshard on load.

Layout under ``root``::

    step_<n>/           a complete checkpoint (Megatron dist_checkpointing, torch_dist format)
    .tmp-step_<n>/      a save in progress, or one killed mid-write: never loaded
    latest              "step_<n>", replaced atomically after step_<n> is in place

Contract: ``save_checkpoint`` is collective; every rank writes its shards into the temporary
directory, then rank 0 renames it to ``step_<n>`` and only then rewrites ``latest``. So a crash at
any point leaves ``latest`` naming a complete checkpoint. ``load_checkpoint`` loads what ``latest``
names into model chunks of any TP/PP (and EP, model only) layout, logging which incomplete or newer
directories it ignored. Optimizer state reshards over TP/PP/DP (Megatron's fully_reshardable format); RNG
states are restored only when the layout is unchanged.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import get_model_config

from megatron_bridge.live import mapped_tensors
from rltrain.megatron.parallel import ParallelContext

logger = logging.getLogger(__name__)

LATEST = "latest"
_TMP_PREFIX = ".tmp-"


def _layout(ctx: ParallelContext) -> dict[str, int | None]:
    layout = {"tp": ctx.tp_size, "pp": ctx.pp_size, "vpp": ctx.vpp_size, "ep": ctx.ep_size, "dp": ctx.dp_size}
    if ctx.etp_size != ctx.tp_size:  # only then: checkpoints written before the key resume as before
        layout["etp"] = ctx.etp_size
    return layout


def _routing(chunks: list[torch.nn.Module]) -> dict[str, Any] | None:
    """How a mixture-of-experts model's routers choose experts (None for a dense model): what a
    conversion to the HF family must be able to express."""
    config = get_model_config(chunks[0])
    if not getattr(config, "num_moe_experts", None):
        return None
    return {
        "score_function": config.moe_router_score_function,
        "expert_bias": bool(config.moe_router_enable_expert_bias),
    }


def saved_routing(step_dir: str | Path) -> dict[str, Any] | None:
    """The routing ``save_checkpoint`` recorded in ``step_dir`` (None: a dense model, or a checkpoint
    written before the record, or not by ``save_checkpoint``)."""
    if not (Path(step_dir) / "common.pt").is_file():
        return None
    return dist_checkpointing.load_common_state_dict(str(step_dir)).get("meta", {}).get("routing")


def _rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _model_key(index: int, num_chunks: int) -> str:
    return "model" if num_chunks == 1 else f"model{index}"


def _sharded_state(
    ctx: ParallelContext,
    chunks: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    *,
    loading: bool,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    state: dict[str, Any] = {
        _model_key(i, len(chunks)): _model_state(chunk, keep) for i, chunk in enumerate(chunks)
    }
    if optimizer is not None:
        # The default model-space format fails in 0.16.1 ("ShardedTensor.flattened_range is not
        # supported"); fully_reshardable gathers each DP group's shards and reshards over TP/PP/DP.
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"}
        )
    if ctx.etp_size == ctx.tp_size:
        shape, offset, replica = (
            (ctx.pp_size, ctx.tp_size, ctx.ep_size),
            (ctx.pp_rank, ctx.tp_rank, ctx.ep_rank),
            ctx.expert_dp_rank,
        )
    else:
        # Expert-TP != TP ties the EP rank to the TP rank (TP=2, expert-TP=1, EP=2: ranks hold
        # (tp, ep) = (0, 0) and (1, 1) only), so (pp, tp, ep) has holes: every rank keeps its own.
        shape, offset, replica = (ctx.world_size,), (ctx.rank,), 0
    state["rng_state"] = ShardedObject("rng_state", _rng_state(), shape, offset, replica_id=replica)
    return state


def _model_state(chunk: torch.nn.Module, keep: Callable[[str], bool] | None) -> dict[str, Any]:
    """The chunk's sharded state dict, only the keys ``keep`` accepts when given."""
    state = chunk.sharded_state_dict()
    return state if keep is None else {key: value for key, value in state.items() if keep(key)}


def _load_model_state(
    chunk: torch.nn.Module, state: dict[str, Any], keep: Callable[[str], bool] | None
) -> None:
    """Load ``state`` into ``chunk``: strictly, or (``keep``) every key ``keep`` accepts."""
    if keep is None:
        chunk.load_state_dict(state)
        return
    result = chunk.load_state_dict(state, strict=False)
    missing = [key for key in result.missing_keys if keep(key)]
    if missing or result.unexpected_keys:
        raise KeyError(f"checkpoint model state: missing {missing}, unexpected {result.unexpected_keys}")


def _has_state(optimizer: MegatronOptimizer | None) -> bool:
    """Whether the optimizer has stepped (Megatron cannot save an Adam state that has no ``step``)."""
    if optimizer is None:
        return False
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(len(sub.optimizer.state) > 0 for sub in subs if getattr(sub, "optimizer", None) is not None)


def _allocate_optimizer_state(optimizer: MegatronOptimizer) -> None:
    """A fresh Adam has no state to load into (``DistributedOptimizer.state_dict`` asserts on the missing
    ``step``): take Megatron's own zero-gradient dummy step, whose values the load then overwrites."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        allocate = getattr(sub, "_init_optimizer_states_with_dummy_values", None)
        if allocate is not None:
            allocate()


def _unshare_adam_steps(optimizer: MegatronOptimizer) -> None:
    """Without Apex/TE, ``DistributedOptimizer.load_state_dict`` gives every parameter the *same* ``step``
    tensor; torch's Adam increments it in place once per parameter, which corrupts the bias
    correction of every later step. Give each parameter its own copy."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        for state in inner.state.values() if inner is not None else []:
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def _use_plain_write_queue() -> None:
    """Give Megatron's checkpoint writer a plain queue instead of its spawn-context Manager queue.

    Our saves are synchronous, so the results are put and read in this process (a thread-safe
    ``queue.Queue`` suffices; an ``mp.Queue`` is read back before its feeder thread delivers); the
    Manager's server process re-imports ``__main__`` (8-13 s on a small machine, and a hang without a
    main guard) and outlives a killed trainer.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(
    root: str | Path,
    *,
    step: int,
    ctx: ParallelContext,
    chunks: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None = None,
    scheduler: OptimizerParamScheduler | None = None,
    sharded_strategy: Any = None,
    keep: Callable[[str], bool] | None = None,
) -> Path:
    """Write ``root/step_<step>`` atomically (collective); returns its path.

    ``keep``: the keys of each chunk's state dict the model checkpoint holds (model converters,
    ``rltrain.megatron.converters.checkpoint_filter``); None: all.

    ``sharded_strategy``: Megatron's save strategy (default torch_dist); the conversion tools pass a
    ``streamed_checkpoint.StreamedSaveStrategy`` to write models that sit on the meta device.
    """
    root = Path(root)
    name = f"step_{step}"
    tmp, final = root / f"{_TMP_PREFIX}{name}", root / name
    if ctx.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    _use_plain_write_queue()
    # A never-stepped optimizer equals a fresh one: save the model alone and say so in the metadata.
    with_optimizer = _has_state(optimizer)
    state = _sharded_state(ctx, chunks, optimizer if with_optimizer else None, loading=False, keep=keep)
    state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    state["meta"] = {
        "step": step,
        "layout": _layout(ctx),
        "num_chunks": len(chunks),
        "optimizer": with_optimizer,
    }
    routing = _routing(chunks)
    if routing is not None:
        state["meta"]["routing"] = routing
    dist_checkpointing.save(state, str(tmp), sharded_strategy=sharded_strategy)
    dist.barrier()
    if ctx.rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker = root / f"{_TMP_PREFIX}{LATEST}"
        marker.write_text(name)
        os.replace(marker, root / LATEST)
    dist.barrier()
    return final


def find_latest(root: str | Path) -> Path | None:
    """The checkpoint ``latest`` names (None if none), logging ignored incomplete/newer directories."""
    root = Path(root)
    marker = root / LATEST
    latest = root / marker.read_text().strip() if marker.exists() else None
    for entry in sorted(root.iterdir()) if root.exists() else []:
        if entry.name.startswith(_TMP_PREFIX) and entry.is_dir():
            logger.warning("ignoring incomplete checkpoint %s (a save that did not finish)", entry)
        elif entry.name.startswith("step_") and (latest is None or _step_of(entry) > _step_of(latest)):
            logger.warning("ignoring checkpoint %s: %s names %s", entry, marker, latest)
    if latest is not None and not (latest / "metadata.json").exists():
        raise FileNotFoundError(f"{marker} names {latest}, which is not a complete checkpoint")
    return latest


def _step_of(path: Path) -> int:
    suffix = path.name.removeprefix("step_")
    return int(suffix) if suffix.isdigit() else -1


def load_checkpoint(
    root: str | Path,
    *,
    ctx: ParallelContext,
    chunks: list[torch.nn.Module],
    optimizer: MegatronOptimizer | None = None,
    scheduler: OptimizerParamScheduler | None = None,
    keep: Callable[[str], bool] | None = None,
) -> int | None:
    """Load the checkpoint ``root/latest`` names into ``chunks`` (and optimizer/scheduler when given).

    Returns its step, or None when ``root`` has no checkpoint. ``keep``: as for ``save_checkpoint``;
    the checkpoint must then hold every key it accepts.
    """
    path = find_latest(root)
    if path is None:
        return None
    meta = dist_checkpointing.load_common_state_dict(str(path))["meta"]
    same_layout = meta["layout"] == _layout(ctx)
    if optimizer is not None and not meta["optimizer"]:
        logger.info("%s was saved before the first optimizer step: optimizer state stays fresh", path)
        optimizer = None
    if optimizer is not None and not _has_state(optimizer):
        _allocate_optimizer_state(optimizer)
    state = _sharded_state(ctx, chunks, optimizer, loading=True, keep=keep)
    if not same_layout:
        del state["rng_state"]
        logger.info(
            "checkpoint layout %s differs from %s: RNG states not restored", meta["layout"], _layout(ctx)
        )
    loaded = dist_checkpointing.load(state, str(path))
    for i, chunk in enumerate(chunks):
        _load_model_state(chunk, loaded[_model_key(i, len(chunks))], keep)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(optimizer)
    if scheduler is not None and loaded.get("scheduler") is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    return int(meta["step"])


def checkpoint_keys(chunks: list[torch.nn.Module]) -> list[dict[str, tuple[str, tuple[int, ...]]]]:
    """Where each parameter lives in a checkpoint: per chunk, ``{name: (key, index)}``.

    ``name`` is the parameter's name in the (unwrapped) chunk, ``key`` Megatron's sharded key and
    ``index`` the parameter's position along the key's prepended axes (global layer, then global
    expert). The full, unsharded parameter is the checkpoint tensor ``key[index]`` (Megatron
    stores a TP-split tensor as one global tensor, a gated fc1 as ``[gate; up]``). Works on meta
    models; reads no data. Raises for a parameter stored under two keys or indices.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def leaves(value: Any):
        if isinstance(value, ShardedTensorFactory):
            yield from leaves(value.build())
        elif isinstance(value, dict):
            for v in value.values():
                yield from leaves(v)
        elif isinstance(value, list | tuple):
            for v in value:
                yield from leaves(v)
        elif isinstance(value, ShardedTensor):
            yield value

    out = []
    for chunk in chunks:
        while hasattr(chunk, "module"):
            chunk = chunk.module
        # Parameters and persistent buffers (a router's expert_bias), as the bridge maps them.
        by_storage = {p.untyped_storage()._cdata: n for n, p in mapped_tensors(chunk)}
        found: dict[str, tuple[str, tuple[int, ...]]] = {}
        for sh in leaves(chunk.sharded_state_dict()):
            name = by_storage.get(sh.data.untyped_storage()._cdata)
            if name is None:
                continue
            where = (sh.key, tuple(sh.global_offset[: sh.prepend_axis_num]))
            if found.setdefault(name, where) != where:
                raise NotImplementedError(f"parameter {name!r} is stored under {found[name]} and {where}")
        out.append(found)
    return out
