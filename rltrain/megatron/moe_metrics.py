"""Router statistics of one train step of an MoE model: expert load, aux and z losses, entropy.

Contract: ``RouterStats(chunks)`` finds the model's top-k routers; ``with stats.recording():``
around the forward-backward of a train step counts, in every router forward that trains (module in
training mode, grad enabled: the update passes, once per micro-batch also under recomputation), the
tokens each expert was routed to (the router's own routing map, after the expert bias) and the
entropy of each token's router distribution; ``stats.metrics(ctx)`` reduces them over every rank
(a collective of the role) and returns the same numbers on every rank:

``moe/load_max_over_mean``   max over experts / mean over experts of the tokens routed to each
                             expert in the step, averaged over MoE layers (1 = perfectly balanced)
``moe/aux_loss``             Megatron-Core's load-balancing loss without its coefficient
                             (E/(k·T²)·Σ_i P_i·f_i over a micro-batch's T tokens), mean over
                             micro-batches, data-parallel ranks and MoE layers; with an aux-loss
                             coefficient > 0 only (Megatron computes it then)
``moe/z_loss``               mean over tokens of logsumexp(router logits)², same means; with
                             ``model.moe.moe_z_loss_coeff`` only
``moe/router_entropy``       mean over the step's tokens of H(p), p the softmax of the router
                             logits (sigmoid scores normalized to sum 1 with the sigmoid score
                             function), averaged over MoE layers
``moe/expert_bias_abs_max``  largest |expert bias| after the step (aux-loss-free routing only)

With ``per_layer`` each also comes per layer as ``moe/layer_<n>/<name>`` (n: Megatron's 1-based
layer number), plus ``moe/layer_<n>/tokens_per_expert_max`` and ``..._min``.

Reductions: the load and entropy are sums over tokens, so they are summed over data-parallel ranks
(which hold distinct tokens; with expert parallelism the EP ranks are among them) and, with
sequence parallelism, over TP ranks (without it the TP ranks route the same tokens: not summed);
each layer lives on one pipeline stage, so the per-layer rows are summed over PP. The aux and z
losses come from Megatron-Core's own tracker (``save_to_aux_losses_tracker``: exactly what was added
to the loss, divided by its coefficient), summed over micro-batches per rank; this module divides
by the micro-batch count, sums the aux loss over TP (each TP rank holds its share, as Megatron's
``reduce_aux_losses_tracker_across_ranks`` does) and averages both over DP. Departure from
Megatron's own logging: its z-loss is not averaged over DP (rank 0's is logged); here it is.

Padding: the routers see every token of a micro-batch, including the padding the layout adds (a
packed row padded to a multiple of TP under sequence parallelism, to the longest micro-batch under
VPP; the padded rows of ``use_remove_padding: false``), and count it, as Megatron-Core's aux loss
and expert-bias loads do when, as here, no padding mask reaches the router.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
)
from megatron.core.transformer.moe.router import TopKRouter

from rltrain.megatron.parallel import ParallelContext

AUX_LOSS_TRACKER_NAME = "load_balancing_loss"
"""Megatron's tracker name of the ``aux_loss`` load-balancing type."""
Z_LOSS_TRACKER_NAME = "z_loss"
PREFIX = "moe/"


def router_entropy(logits: torch.Tensor, *, score_function: str) -> torch.Tensor:
    """Per-token entropy [tokens] of the router distribution over experts from logits [tokens, E]."""
    logits = logits.float()
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        log_p = torch.log(scores) - torch.log(scores.sum(-1, keepdim=True))
    else:
        log_p = torch.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


class RouterStats:
    """Per-layer router counters of a train step over this rank's model chunks."""

    def __init__(self, chunks: list[torch.nn.Module], *, per_layer: bool = False) -> None:
        config = chunks[0].config
        # the decoder's routers (a multi-token-prediction layer's, layer num_layers + 1, has no row)
        self.routers: list[TopKRouter] = [
            m
            for chunk in chunks
            for m in chunk.modules()
            if isinstance(m, TopKRouter) and m.layer_number <= config.num_layers
        ]
        self.per_layer = per_layer
        self.num_layers: int = config.num_layers
        self.num_experts: int = config.num_moe_experts or 0
        self.score_function: str = config.moe_router_score_function
        # Decided by the config, the same on every rank (a stage may hold no MoE layer).
        self.track_aux_loss = config.moe_router_load_balancing_type == "aux_loss" and bool(
            config.moe_aux_loss_coeff
        )
        self.track_z_loss = config.moe_z_loss_coeff is not None
        self.expert_bias = bool(config.moe_router_enable_expert_bias)
        # Rows per global layer: tokens per expert [E], entropy sum, token count, micro-batches.
        self._sums = torch.zeros(self.num_layers, self.num_experts + 3, dtype=torch.float64)

    def __bool__(self) -> bool:
        # By the config, not this rank's routers: every rank of the role takes part in metrics().
        return self.num_experts > 0

    def _hook(self, router: TopKRouter, args: tuple, output: tuple) -> None:
        if not (router.training and torch.is_grad_enabled()):
            return
        with torch.no_grad():
            logits = router.gating(args[0]).reshape(-1, self.num_experts)
            routing_map = output[1]
            row = self._sums[router.layer_number - 1]
            row[: self.num_experts] += routing_map.sum(0).to(row)
            row[self.num_experts] += float(router_entropy(logits, score_function=self.score_function).sum())
            row[self.num_experts + 1] += logits.shape[0]
            row[self.num_experts + 2] += 1

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Count router forwards inside; clears the counters and Megatron's aux-loss tracker first."""
        self._sums.zero_()
        clear_aux_losses_tracker()
        handles = [r.register_forward_hook(self._hook) for r in self.routers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def metrics(self, ctx: ParallelContext) -> dict[str, float]:
        """The step's ``moe/...`` metrics, identical on every rank (collective over the role's ranks)."""
        device = ctx.device
        sums = self._sums.to(device)
        micro = sums[:, -1].clone()  # this rank's micro-batches per layer (for the loss means)
        groups = ctx.groups
        dist.all_reduce(sums, group=groups.pp)
        dist.all_reduce(sums, group=groups.dp_cp)
        if ctx.parallel.sequence_parallel and ctx.tp_size > 1:
            dist.all_reduce(sums, group=groups.tp)
        moe_layers = (sums[:, -2] > 0).nonzero().flatten().tolist()
        if not moe_layers:
            return {}
        counts = sums[:, : self.num_experts]
        per_layer: dict[str, torch.Tensor] = {
            "load_max_over_mean": counts.max(-1).values / counts.mean(-1).clamp(min=1e-12),
            "router_entropy": sums[:, self.num_experts] / sums[:, self.num_experts + 1].clamp(min=1),
        }
        per_layer.update(self._tracked_losses(ctx, micro=micro))
        out: dict[str, float] = {}
        for name, values in per_layer.items():
            out[f"{PREFIX}{name}"] = float(values[moe_layers].mean())
        if self.expert_bias:
            local = [r.expert_bias.detach().abs().max().double().cpu() for r in self.routers]
            largest = torch.stack(local or [torch.zeros((), dtype=torch.float64)]).max().to(device)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=groups.pp)
            out[f"{PREFIX}expert_bias_abs_max"] = float(largest)
        if self.per_layer:
            per_layer["tokens_per_expert_max"] = counts.max(-1).values
            per_layer["tokens_per_expert_min"] = counts.min(-1).values
            for name, values in per_layer.items():
                for layer in moe_layers:
                    out[f"{PREFIX}layer_{layer + 1}/{name}"] = float(values[layer])
        return out

    def _tracked_losses(self, ctx: ParallelContext, *, micro: torch.Tensor) -> dict[str, torch.Tensor]:
        """Megatron's tracked aux and z losses per layer, mean over micro-batches and DP ranks."""
        tracker: dict[str, Any] = get_moe_layer_wise_logging_tracker()
        groups = ctx.groups
        out = {}
        for name, key, sum_over_tp, tracked in (
            ("aux_loss", AUX_LOSS_TRACKER_NAME, True, self.track_aux_loss),
            ("z_loss", Z_LOSS_TRACKER_NAME, False, self.track_z_loss),
        ):
            if not tracked:
                continue
            entry = tracker.get(key)
            values = torch.zeros(self.num_layers, dtype=torch.float64, device=ctx.device)
            if entry is not None:
                values += entry["values"].detach().to(ctx.device, torch.float64)
            values /= micro.clamp(min=1)
            dist.all_reduce(values, group=groups.pp)
            if ctx.tp_size > 1:
                dist.all_reduce(values, group=groups.tp)
                if not sum_over_tp:
                    values /= ctx.tp_size
            dist.all_reduce(values, group=groups.dp_cp)
            out[name] = values / (ctx.dp_size * ctx.cp_size)
        clear_aux_losses_tracker()
        return out
