"""MoE routing replay inside a forward pass: record the experts every router chose, or make every
router use given ones (verl's ``router_replay.mode``; Megatron's ``RouterReplay``).

Contract: :func:`arm_routers` sets the action of every router of the chunks for a pass (``record``;
``replay`` is set per micro-batch by :func:`set_replay_targets` from ``batch.routed_experts``);
:func:`collect_recorded` copies what a micro-batch's routers chose into ``ModelInputs.recorded``
([batch, seq, num_layers, top_k]) and :func:`gather_routes` puts the micro-batches back in sample
order and completes them over the TP ranks (sequence-parallel shares) and pipeline stages (their
layers), so every rank returns the same routes.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

from rltrain.algo.token_batch import TokenBatch
from rltrain.megatron.micro_batches import ModelInputs
from rltrain.megatron.model import gpt_model
from rltrain.megatron.parallel import ParallelContext

Replay = Literal["record", "replay"]
"""Routing replay of a pass: ``record`` the routers' top-k per token (returned as
``ModelOutput.routed_experts``), or ``replay`` ``batch.routed_experts`` instead of choosing."""


def replay_routers(model: torch.nn.Module) -> list[tuple[int, Any]]:
    """(0-based global layer, RouterReplay) of each MoE router in ``model`` (this stage's layers)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [
        (m.layer_number - 1, m.router_replay)
        for m in model.modules()
        # a multi-token-prediction layer's router (layer num_layers + 1) is not the decoder's
        if isinstance(m, TopKRouter) and m.router_replay is not None and m.layer_number <= m.config.num_layers
    ]


def _router_order(inputs: ModelInputs, *, ctx: ParallelContext) -> tuple[torch.Tensor, int, int]:
    """[batch, seq] index of each real token in the routers' token order over the whole sequence
    (Megatron flattens [tokens, rows] sequence-first), -1 on padding; plus this TP rank's share of
    that order under sequence parallelism as (start, count)."""
    rows, tokens = inputs.input_ids.shape
    p = inputs.layout_index
    order = torch.where(p >= 0, (p % tokens) * rows + p // tokens, -1)
    total = rows * tokens
    if ctx.parallel.sequence_parallel and ctx.tp_size > 1:
        share = total // ctx.tp_size
        return order, ctx.tp_rank * share, share
    return order, 0, total


def set_replay_targets(routers: list, inputs: ModelInputs, *, ctx: ParallelContext) -> None:
    """Point every router of this chunk at ``inputs.batch.routed_experts`` in its token order;
    padding positions get experts 0..k-1 (they are masked out of attention and the loss)."""
    routes = inputs.batch.routed_experts
    if routes is None:
        raise ValueError("routing replay: the batch has no routed_experts to replay")
    order, start, count = _router_order(inputs, ctx=ctx)
    valid = order >= 0
    routes = routes.to(ctx.device, torch.long)  # R3 hands int16 over (engine_routes)
    rows, tokens = inputs.input_ids.shape
    top_k = routes.size(-1)
    for layer, replay in routers:
        target = torch.arange(top_k, device=ctx.device).expand(rows * tokens, top_k).clone()
        target[order[valid]] = routes[:, :, layer][valid]
        replay.clear_indices()
        replay.set_target_indices(target[start : start + count])
        replay.set_router_replay_action(_action("REPLAY_FORWARD"))


def collect_recorded(routers: list, inputs: ModelInputs, *, ctx: ParallelContext) -> None:
    """Copy what this chunk's routers recorded into ``inputs.recorded`` ([batch, seq, layers, k])."""
    order, start, count = _router_order(inputs, ctx=ctx)
    valid = order >= 0
    rows, tokens = inputs.input_ids.shape
    for layer, replay in routers:
        chosen = replay.get_recorded_indices()
        full = torch.zeros(rows * tokens, chosen.size(-1), dtype=torch.long, device=ctx.device)
        full[start : start + count] = chosen
        inputs.recorded[:, :, layer][valid] = full[order[valid]]
        replay.clear_indices()


def _action(name: str) -> Any:
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    return getattr(RouterReplayAction, name)


def arm_routers(chunks: list[torch.nn.Module], replay: Replay | None) -> list:
    """Set the routers' replay action for a pass (``record`` here; ``replay`` per micro-batch)."""
    routers = [r for chunk in chunks for r in replay_routers(chunk)] if replay else []
    if replay and not routers and _any_moe_config(chunks):
        raise ValueError("routing replay: no router of this model has a RouterReplay")
    for _, router in routers:
        router.clear_indices()
        if replay == "record":
            router.set_router_replay_action(_action("RECORD"))
    return routers


def _any_moe_config(chunks: list[torch.nn.Module]) -> bool:
    return any(getattr(gpt_model(c).config, "num_moe_experts", None) for c in chunks)


def gather_routes(
    micro: list[ModelInputs], splits: list[list[int]], batch: TokenBatch, *, ctx: ParallelContext
) -> torch.Tensor:
    """The recorded routes of every micro-batch in sample order, completed over the TP ranks
    (sequence-parallel shares) and the pipeline stages (their layers): a max, the missing entries
    being 0 and expert ids non-negative."""
    recorded = torch.cat([m.recorded for m in micro])
    order = torch.tensor([i for idx in splits for i in idx], device=ctx.device)
    routes = torch.empty_like(recorded)
    routes[order] = recorded
    if ctx.tp_size > 1:
        dist.all_reduce(routes, op=dist.ReduceOp.MAX, group=ctx.groups.tp)
    if ctx.pp_size > 1:
        dist.all_reduce(routes, op=dist.ReduceOp.MAX, group=ctx.groups.pp)
    return routes
