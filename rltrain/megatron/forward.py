"""Forward (and forward-backward) of Megatron model chunks over a batch of token sequences.

Contract: ``run_model`` takes a :class:`~rltrain.algo.token_batch.TokenBatch` (padded rows
``[prompt (left-padded) | response (right-padded)]``, the last ``response_len`` columns being the
response), splits it into micro-batches (fixed size, or filled up to a token budget), optionally
packs each micro-batch into one row (THD, no attention across sequences, positions restarting per
sequence), runs them through Megatron's pipeline schedule, and returns, in the original sample
order, a :class:`~rltrain.algo.token_batch.ModelOutput` with ``logprobs``/``entropy`` (actor,
``outputs="logprobs"``) or ``values`` (critic, ``outputs="values"``), each [batch, response_len],
zero on padding, or (reward model, ``outputs="scores"``) ``scores`` [batch]. The output for
response token j comes from position ``seq - response_len - 1 + j`` (the token before it), as in
verl; a row's score is the scalar head's output at its last token with attention mask 1 (the last
response token; the last prompt token for an empty response), where an HF sequence classifier pools.
Every rank of the pipeline gets the same result (broadcast from the last stage). With
``loss_fn`` (a :class:`~rltrain.algo.token_batch.LossFn`) it also runs the backward; the loss
callable sees one micro-batch's outputs and must use global denominators (its sum over
micro-batches and data-parallel ranks is the batch loss), so gradients do not depend on the split.

Context parallelism (CP > 1, packed only): each packed micro-batch pads every sequence to a
multiple of 2·CP and CP rank r runs chunks r and 2·CP−1−r of each (Megatron's load balancing,
:func:`~rltrain.data.packing.context_parallel_index`), with the global positions and the whole
row's ``cu_seqlens`` (Megatron's THD RoPE and the attention cut their share from them). Targets
come from the unsplit batch, so a chunk boundary never loses a next token. Each rank computes the
head outputs of the response tokens whose predictor it holds; a sum over the CP group (gradient
passed through unchanged) gives every CP rank the full [batch, response_len] outputs, so the loss
callable sees what it sees at CP = 1 (whole sequences, the same global counts) and every CP rank
computes the same loss. Each rank's backward then reaches only its own tokens' activations, and
the DP×CP gradient reduction of Megatron's DDP adds the shares up. A dynamic micro-batch's token
budget counts the tokens one CP rank holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from rltrain.algo.token_batch import LossFn, ModelOutput, TokenBatch
from rltrain.megatron.head_outputs import (
    OUTPUT_NAMES,
    FusedHead,
    HiddenStatesOut,
    Outputs,
    head_outputs,
    head_scores,
)
from rltrain.megatron.micro_batches import MicroBatching, ModelInputs, micro_batches
from rltrain.megatron.model import gpt_model
from rltrain.megatron.mtp import trained_mtp_layers
from rltrain.megatron.parallel import ParallelContext
from rltrain.megatron.router_replay import (
    Replay,
    arm_routers,
    collect_recorded,
    gather_routes,
    replay_routers,
    set_replay_targets,
)


@dataclass
class ForwardResult:
    """Outputs of ``run_model`` on every pipeline rank."""

    output: ModelOutput
    """Per-response-token outputs in the original sample order (empty for ``outputs="scores"`` and
    for a forward-backward pass)."""
    metrics: dict[str, float]
    """Loss-callable metrics (and ``loss``) summed over micro-batches and data-parallel ranks;
    empty for a forward-only pass."""
    scores: torch.Tensor | None = None
    """[batch] float32 reward-model scores in the original sample order (``outputs="scores"``)."""


def run_model(
    chunks: list[torch.nn.Module],
    batch: TokenBatch,
    *,
    ctx: ParallelContext,
    batching: MicroBatching,
    outputs: Outputs = "logprobs",
    loss_fn: LossFn | None = None,
    vocab_size: int | None = None,
    fused: FusedHead | None = None,
    router_replay: Replay | None = None,
) -> ForwardResult:
    """Forward (``loss_fn=None``, no grad) or forward-backward of ``batch`` through ``chunks``.

    ``outputs``: what the chunks' head gives (``"values"`` and ``"scores"`` need the scalar head of
    the critic / reward role); ``"scores"`` is forward-only. ``vocab_size``: the real vocabulary when
    the model's is padded (None: not padded). ``fused`` (``outputs="logprobs"``): the last stage's LM
    head runs inside the fused kernel on the response tokens' hidden states, never materialising
    [tokens, vocab] logits (the chunks' ``output_layer`` is swapped for the pass and put back).
    ``router_replay`` (MoE): ``record`` returns the experts every router chose for every token as
    ``output.routed_experts`` ([batch, seq, num_layers, top_k], the same on every TP/PP rank);
    ``replay`` makes every router use ``batch.routed_experts`` instead of its own top-k.
    """
    swapped = None  # (the last stage's model, its output_layer) while the fused head stands in
    if fused is not None and outputs == "logprobs":
        heads = [m for m in map(gpt_model, chunks) if getattr(m, "output_layer", None) is not None]
        if heads:  # else not a last pipeline stage: nothing to fuse here
            (model,) = heads  # one last stage (the VPP chunk with the head)
            swapped = (model, model.output_layer)
            model.output_layer = HiddenStatesOut(model.output_layer)
    try:
        return _run_model(
            chunks,
            batch,
            ctx=ctx,
            batching=batching,
            outputs=outputs,
            loss_fn=loss_fn,
            vocab_size=vocab_size,
            fused=None if swapped is None else (fused, swapped[0].output_layer),
            router_replay=router_replay,
        )
    finally:
        if swapped is not None:
            swapped[0].output_layer = swapped[1]


def _run_model(
    chunks: list[torch.nn.Module],
    batch: TokenBatch,
    *,
    ctx: ParallelContext,
    batching: MicroBatching,
    outputs: Outputs,
    loss_fn: LossFn | None,
    vocab_size: int | None,
    fused: tuple[FusedHead, HiddenStatesOut] | None = None,
    router_replay: Replay | None = None,
) -> ForwardResult:
    if outputs not in OUTPUT_NAMES:
        raise ValueError(f"outputs={outputs!r}; expected one of {', '.join(OUTPUT_NAMES)}")
    if outputs == "scores" and loss_fn is not None:
        raise ValueError(
            "outputs='scores' is forward-only (no loss_fn): the reward model is not trained here"
        )
    if ctx.cp_size > 1 and not batching.use_remove_padding:
        raise ValueError(
            "use_remove_padding=false with parallel.context_parallel_size > 1: CP splits packed sequences only"
        )
    if ctx.device.type == "cuda" and not batching.use_remove_padding:
        # Megatron's TE attention runs bshd/sbhd with mask type 'causal', which ignores the padding mask.
        raise NotImplementedError("use_remove_padding=false on GPU: padded rows would attend to padding")
    splits = batching.split(batch, cp_size=ctx.cp_size)
    micro = micro_batches(batch, splits, ctx=ctx, batching=batching)
    forward_only = loss_fn is None
    step = partial(
        _forward_step,
        ctx=ctx,
        outputs=outputs,
        vocab_size=vocab_size,
        loss_fn=loss_fn,
        loss_scale=float(len(micro) * ctx.dp_size * ctx.cp_size),
        fused=fused,
        replay=router_replay,
    )
    iterators: Any = [iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro)
    for chunk in chunks:
        chunk.train(not forward_only)
    routers = arm_routers(chunks, router_replay)
    try:
        with torch.set_grad_enabled(not forward_only):
            stored = get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=iterators,
                model=chunks if len(chunks) > 1 else chunks[0],
                num_microbatches=len(micro),
                seq_length=max(m.input_ids.size(1) for m in micro),
                micro_batch_size=max(m.input_ids.size(0) for m in micro),
                forward_only=forward_only,
            )
    finally:
        for _, router in routers:
            router.clear_indices()
            router.clear_router_replay_action()
    routes = gather_routes(micro, splits, batch, ctx=ctx) if router_replay == "record" else None
    if not forward_only:
        return ForwardResult(output=ModelOutput(routed_experts=routes), metrics=_sum_metrics(stored, ctx=ctx))
    gathered = _gather_outputs(stored, splits, batch, ctx=ctx, outputs=outputs)
    scores = gathered.pop("scores", None)
    return ForwardResult(output=ModelOutput(**gathered, routed_experts=routes), metrics={}, scores=scores)


def _forward_step(
    data_iterator: Any,
    model: torch.nn.Module,
    *,
    ctx: ParallelContext,
    outputs: Outputs,
    vocab_size: int | None,
    loss_fn: LossFn | None,
    loss_scale: float,
    fused: tuple[FusedHead, HiddenStatesOut] | None = None,
    replay: Replay | None = None,
) -> tuple[torch.Tensor, Callable]:
    inputs: ModelInputs = next(data_iterator)
    routers = replay_routers(model) if replay else []
    if replay == "replay":
        set_replay_targets(routers, inputs, ctx=ctx)
    output = model(
        input_ids=inputs.input_ids,
        position_ids=inputs.position_ids,
        attention_mask=inputs.attention_mask,
        packed_seq_params=inputs.packed_seq_params,
    )
    if replay == "record":
        if inputs.recorded is None:
            config = gpt_model(model).config
            shape = (*inputs.batch.input_ids.shape, config.num_layers, config.moe_router_topk)
            inputs.recorded = torch.zeros(shape, dtype=torch.long, device=ctx.device)
        collect_recorded(routers, inputs, ctx=ctx)

    def loss_func(output_tensor: torch.Tensor) -> tuple:
        if outputs == "scores":
            return output_tensor.new_zeros(()), {"scores": head_scores(output_tensor, inputs, ctx=ctx)}
        out = head_outputs(
            output_tensor,
            inputs,
            ctx=ctx,
            outputs=outputs,
            vocab_size=vocab_size,
            fused=fused,
            mtp_layers=trained_mtp_layers(model),
        )
        if loss_fn is None:
            return output_tensor.new_zeros(()), {name: getattr(out, name) for name in OUTPUT_NAMES[outputs]}
        loss, metrics = loss_fn(out, inputs.batch.to(output_tensor.device))
        # Megatron divides by the number of micro-batches and averages gradients over DP×CP; the
        # loss already carries global denominators, so undo both (one token count per micro-batch).
        reduced = {"loss": loss.detach(), **{k: torch.as_tensor(v).detach() for k, v in metrics.items()}}
        return loss * loss_scale, torch.tensor(1, dtype=torch.int), reduced

    return output, loss_func


def _gather_outputs(
    stored: list[dict],
    splits: list[list[int]],
    batch: TokenBatch,
    *,
    ctx: ParallelContext,
    outputs: Outputs,
) -> dict[str, torch.Tensor]:
    """Restore sample order on the last stage and broadcast to the other pipeline stages."""
    names = OUTPUT_NAMES[outputs]
    shape = (batch.batch_size,) if outputs == "scores" else (batch.batch_size, batch.response_len)
    result = {name: torch.zeros(shape, dtype=torch.float32, device=ctx.device) for name in names}
    if ctx.is_pipeline_last_stage:
        order = torch.tensor([i for idx in splits for i in idx], device=ctx.device)
        for name in names:
            result[name][order] = torch.cat([s[name] for s in stored]).float()
    if ctx.pp_size > 1:
        for name in names:
            dist.broadcast(result[name], src=ctx.pipeline_last_rank, group=ctx.groups.pp)
    return result


def _sum_metrics(stored: list[dict], *, ctx: ParallelContext) -> dict[str, float]:
    """Sum micro-batch metrics, then over DP ranks; broadcast from the last pipeline stage.

    Over the DP group without CP: the CP ranks of a replica computed the same loss (module docstring)."""
    names = sorted(stored[0]) if stored else []
    count = torch.tensor([len(names)], device=ctx.device)
    if ctx.pp_size > 1:
        dist.broadcast(count, src=ctx.pipeline_last_rank, group=ctx.groups.pp)
    values = torch.zeros(int(count), dtype=torch.float64, device=ctx.device)
    if ctx.is_pipeline_last_stage:
        values = torch.stack([sum(s[n].double().sum() for s in stored) for n in names])
        dist.all_reduce(values, group=ctx.groups.dp)
    if ctx.pp_size > 1:
        names_list = [names]
        dist.broadcast_object_list(names_list, src=ctx.pipeline_last_rank, group=ctx.groups.pp)
        names = names_list[0]
        dist.broadcast(values, src=ctx.pipeline_last_rank, group=ctx.groups.pp)
    return dict(zip(names, values.tolist()))
