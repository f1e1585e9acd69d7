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
from typing import Any, Literal

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from rltrain.algo.token_batch import LossFn, ModelOutput, TokenBatch
from rltrain.data.dynamic_batch import split_by_token_budget, split_fixed
from rltrain.data.packing import context_parallel_index, pack_sequences, padded_position_ids
from rltrain.megatron.local_spec import padded_causal_mask
from rltrain.megatron.logprobs import vocab_parallel_logprobs_entropy
from rltrain.megatron.parallel import ParallelContext

Outputs = Literal["logprobs", "values", "scores"]
Replay = Literal["record", "replay"]
"""Routing replay of a pass: ``record`` the routers' top-k per token (returned as
``ModelOutput.routed_experts``), or ``replay`` ``batch.routed_experts`` instead of choosing."""


@dataclass(frozen=True)
class FusedHead:
    """Log-probs and entropy by the fused, chunked LM head of :mod:`kernels.fused_logprob` instead
    of materialised logits (``model.use_fused_kernels``; ``model.fused_kernel_options``)."""

    impl: Literal["torch", "triton"] = "torch"
    """``torch``: the chunked PyTorch reference (any device); ``triton``: the CUDA kernels."""
    chunk_size: int | None = None
    """Tokens whose logits exist at once; None: the kernel's default (256 MiB of fp32 logits)."""


class _HiddenStatesOut(torch.nn.Module):
    """Stands in for a chunk's ``output_layer`` while a fused pass runs: returns the final hidden
    states (gathered over TP under sequence parallelism, whose backward reduce-scatters the partial
    gradients) and keeps the LM-head weight GPTModel handed it (the embedding when tied)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.weight: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, **_: Any) -> tuple:
        self.weight = weight if weight is not None else self.layer.weight
        if getattr(self.layer, "sequence_parallel", False):
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
        return hidden, None


def _gpt_model(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside Megatron's wrappers (DDP, Float16Module)."""
    while hasattr(chunk, "module") and not hasattr(chunk, "output_layer"):
        chunk = chunk.module
    return chunk


"""What a forward pass returns: the LM head's logprobs and entropy, the critic's per-token values,
or the reward model's per-sequence scores."""
_OUTPUT_NAMES: dict[str, tuple[str, ...]] = {
    "logprobs": ("logprobs", "entropy"),
    "values": ("values",),
    "scores": ("scores",),
}


@dataclass
class MicroBatching:
    """How a batch is cut into micro-batches (verl vocabulary)."""

    micro_batch_size: int = 1
    """``ppo_micro_batch_size_per_gpu``: samples per micro-batch when not dynamic."""
    use_dynamic_bsz: bool = False
    """Fill micro-batches up to ``max_token_len`` real tokens instead of a fixed sample count."""
    max_token_len: int = 0
    """``ppo_max_token_len_per_gpu``: token budget of one micro-batch when ``use_dynamic_bsz``."""
    use_remove_padding: bool = True
    """Pack each micro-batch into one row (THD) instead of running padded rows."""

    def split(self, batch: TokenBatch, *, cp_size: int = 1) -> list[list[int]]:
        """Sample indices of each micro-batch; under CP the token budget counts one CP rank's share."""
        if self.use_dynamic_bsz:
            lengths = batch.attention_mask.sum(1).tolist()
            if cp_size > 1:
                lengths = [_cp_padded(n, cp_size) // cp_size for n in lengths]
            return split_by_token_budget(lengths, self.max_token_len)
        return split_fixed(batch.batch_size, self.micro_batch_size)


def _cp_padded(length: int, cp_size: int) -> int:
    """A sequence's length padded to a multiple of 2·CP (what the CP split cuts)."""
    return length + (-length) % (2 * cp_size)


@dataclass
class _ModelInputs:
    """One micro-batch in the layout the model consumes."""

    batch: TokenBatch
    input_ids: torch.Tensor
    """[rows, tokens]: the packed row ([1, total]) or the padded rows ([batch, seq])."""
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    """[batch, 1, seq, seq] bool (True = masked) for padded rows; None when packed."""
    packed_seq_params: PackedSeqParams | None
    source_index: torch.Tensor
    """[batch, response_len] flat index into [rows × tokens] of the position predicting each response
    token (0 where the response is padding)."""
    last_index: torch.Tensor
    """[batch] flat index into [rows × tokens] of each row's last token with attention mask 1."""
    held: torch.Tensor | None = None
    """CP > 1: [batch, response_len] bool, whether this CP rank holds the position predicting each
    response token (``source_index`` is 0 where not); None without CP."""
    last_held: torch.Tensor | None = None
    """CP > 1: [batch] bool, whether this CP rank holds each row's last token; None without CP."""
    layout_index: torch.Tensor | None = None
    """[batch, seq] flat index into [rows × tokens] of each real token of ``batch`` (-1 on padding)."""
    recorded: torch.Tensor | None = None
    """Routing replay ``record``: [batch, seq, num_layers, top_k] routes this rank's routers chose."""


def _prepare(
    batch: TokenBatch,
    *,
    pack: bool,
    pad_to_multiple: int,
    min_length: int,
    device: torch.device,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> _ModelInputs:
    input_ids = batch.input_ids.to(device)
    attention_mask = batch.attention_mask.to(device)
    if not pack and input_ids.size(1) % pad_to_multiple:
        # Sequence parallelism splits the sequence over TP: left-pad the prompt side (masked out).
        extra = pad_to_multiple - input_ids.size(1) % pad_to_multiple
        input_ids = torch.nn.functional.pad(input_ids, (extra, 0))
        attention_mask = torch.nn.functional.pad(attention_mask, (extra, 0))
    seq, resp = input_ids.size(1), batch.response_len
    predictor_cols = torch.arange(seq - resp - 1, seq - 1, device=device)
    valid = attention_mask[:, -resp:].bool()
    last_cols = (torch.arange(seq, device=device) * attention_mask.bool()).argmax(dim=1)
    rows = torch.arange(input_ids.size(0), device=device)
    if pack and cp_size > 1:
        return _prepare_context_parallel(
            batch,
            input_ids,
            attention_mask,
            predictor_cols=predictor_cols,
            last_cols=last_cols,
            pad_to_multiple=pad_to_multiple,
            min_length=min_length,
            cp_size=cp_size,
            cp_rank=cp_rank,
        )
    if pack:
        packed = pack_sequences(
            input_ids, attention_mask, pad_to_multiple=pad_to_multiple, min_length=min_length
        )
        cu = packed.cu_seqlens.to(device)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=packed.max_seqlen,
            max_seqlen_kv=packed.max_seqlen,
        )
        source = packed.token_index[:, predictor_cols].clamp(min=0)
        last = packed.token_index[rows, last_cols].clamp(min=0)
        return _ModelInputs(
            batch,
            packed.input_ids,
            packed.position_ids,
            None,
            params,
            source * valid,
            last,
            layout_index=packed.token_index.to(device),
        )
    source = (rows.unsqueeze(1) * seq + predictor_cols.unsqueeze(0)) * valid
    extra = seq - batch.input_ids.size(1)
    cols = torch.arange(extra, seq, device=device)
    layout = rows.unsqueeze(1) * seq + cols.unsqueeze(0)
    return _ModelInputs(
        batch,
        input_ids,
        padded_position_ids(attention_mask),
        padded_causal_mask(attention_mask),
        None,
        source,
        rows * seq + last_cols,
        layout_index=torch.where(attention_mask[:, extra:].bool(), layout, -1),
    )


def _prepare_context_parallel(
    batch: TokenBatch,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    predictor_cols: torch.Tensor,
    last_cols: torch.Tensor,
    pad_to_multiple: int,
    min_length: int,
    cp_size: int,
    cp_rank: int,
) -> _ModelInputs:
    """The packed micro-batch cut for CP rank ``cp_rank``: its chunks of every sequence."""
    packed = pack_sequences(
        input_ids,
        attention_mask,
        pad_to_multiple=2 * cp_size * pad_to_multiple,
        min_length=min_length,
        pad_each_to_multiple=2 * cp_size,
    )
    cu = packed.cu_seqlens.to(input_ids.device)
    local = context_parallel_index(cu, cp_size=cp_size, cp_rank=cp_rank)
    local_of = torch.full((int(cu[-1]),), -1, dtype=torch.long, device=input_ids.device)
    local_of[local] = torch.arange(local.numel(), device=input_ids.device)
    valid = attention_mask[:, -batch.response_len :].bool()
    source = local_of[packed.token_index[:, predictor_cols].clamp(min=0)]
    held = (source >= 0) & valid
    rows = torch.arange(input_ids.size(0), device=input_ids.device)
    last = local_of[packed.token_index[rows, last_cols].clamp(min=0)]
    # The per-sequence padding is part of each segment (the causal mask hides it from real tokens),
    # so the padded lengths TE's CP attention asks for are the lengths themselves.
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=packed.max_seqlen,
        max_seqlen_kv=packed.max_seqlen,
    )
    return _ModelInputs(
        batch,
        packed.input_ids[:, local],
        packed.position_ids[:, local],
        None,
        params,
        source.clamp(min=0) * held,
        last.clamp(min=0),
        held=held,
        last_held=last >= 0,
    )


class _SumOverContextParallel(torch.autograd.Function):
    """Sum of each CP rank's share (zeros elsewhere) over the CP group; the gradient passes through
    unchanged, because every CP rank then computes the same loss from the sum and each rank's share
    must receive that loss's gradient once."""

    @staticmethod
    def forward(ctx: Any, share: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = share.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _cp_combine(values: torch.Tensor, held: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """values [held tokens] of this CP rank → [held.shape], the whole batch's (summed over CP)."""
    share = values.new_zeros(held.shape)
    share[held] = values
    return _SumOverContextParallel.apply(share, group)


def _head_outputs(
    output: torch.Tensor,
    inputs: _ModelInputs,
    *,
    ctx: ParallelContext,
    outputs: Outputs,
    vocab_size: int | None,
    fused: tuple[FusedHead, _HiddenStatesOut] | None = None,
) -> ModelOutput:
    """output: [rows, tokens, vocab/tp] logits (with ``fused``: [rows, tokens, hidden] final hidden
    states) or [rows, tokens, 1] values → ``ModelOutput``."""
    batch = inputs.batch
    mask = batch.response_mask.to(output.device)
    if inputs.held is not None:
        return _head_outputs_context_parallel(
            output, inputs, ctx=ctx, outputs=outputs, vocab_size=vocab_size, fused=fused
        )
    picked = output.reshape(-1, output.size(-1))[inputs.source_index.flatten()]
    shape = inputs.source_index.shape
    if outputs == "values":
        return ModelOutput(values=picked.squeeze(-1).float().view(shape) * mask)
    targets = batch.input_ids[:, -batch.response_len :].to(output.device).flatten()
    logprobs, entropy = _logprobs_entropy(picked, targets, ctx=ctx, vocab_size=vocab_size, fused=fused)
    return ModelOutput(logprobs=logprobs.view(shape) * mask, entropy=entropy.view(shape) * mask)


def _logprobs_entropy(
    picked: torch.Tensor,
    targets: torch.Tensor,
    *,
    ctx: ParallelContext,
    vocab_size: int | None,
    fused: tuple[FusedHead, _HiddenStatesOut] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """picked: the response tokens' logits [n, vocab/tp], or with ``fused`` their final hidden
    states [n, hidden] (the LM head then runs chunk by chunk inside the kernel)."""
    if fused is None:
        return vocab_parallel_logprobs_entropy(
            picked, targets, tp_group=ctx.groups.tp, tp_rank=ctx.tp_rank, vocab_size=vocab_size
        )
    from kernels.fused_logprob import fused_logprobs_entropy

    head, out_layer = fused
    sequence_parallel = getattr(out_layer.layer, "sequence_parallel", False)
    return fused_logprobs_entropy(
        picked,
        out_layer.weight,
        targets,
        tp_group=ctx.groups.tp,
        tp_rank=ctx.tp_rank,
        vocab_size=vocab_size,
        chunk_size=head.chunk_size,
        all_reduce_grad_hidden=not sequence_parallel,  # SP: the gather's backward reduce-scatters
        impl=head.impl,
    )


def _head_outputs_context_parallel(
    output: torch.Tensor,
    inputs: _ModelInputs,
    *,
    ctx: ParallelContext,
    outputs: Outputs,
    vocab_size: int | None,
    fused: tuple[FusedHead, _HiddenStatesOut] | None = None,
) -> ModelOutput:
    """``_head_outputs`` on this CP rank's tokens only, summed over the CP group."""
    batch, held = inputs.batch, inputs.held
    mask = batch.response_mask.to(output.device)
    picked = output.reshape(-1, output.size(-1))[inputs.source_index[held]]
    if outputs == "values":
        return ModelOutput(values=_cp_combine(picked.squeeze(-1).float(), held, ctx.groups.cp) * mask)
    targets = batch.input_ids[:, -batch.response_len :].to(output.device)[held]
    logprobs, entropy = _logprobs_entropy(picked, targets, ctx=ctx, vocab_size=vocab_size, fused=fused)
    return ModelOutput(
        logprobs=_cp_combine(logprobs, held, ctx.groups.cp) * mask,
        entropy=_cp_combine(entropy, held, ctx.groups.cp) * mask,
    )


def _scores(output: torch.Tensor, inputs: _ModelInputs, *, ctx: ParallelContext) -> torch.Tensor:
    """output: [rows, tokens, 1] scalar head → [batch] float32 at each row's last real token."""
    scores = output.reshape(-1)[inputs.last_index].float()
    if inputs.last_held is None:
        return scores
    return _cp_combine(scores[inputs.last_held], inputs.last_held, ctx.groups.cp)


def _forward_step(
    data_iterator: Any,
    model: torch.nn.Module,
    *,
    ctx: ParallelContext,
    outputs: Outputs,
    vocab_size: int | None,
    loss_fn: LossFn | None,
    loss_scale: float,
    fused: tuple[FusedHead, _HiddenStatesOut] | None = None,
    replay: Replay | None = None,
) -> tuple[torch.Tensor, Callable]:
    inputs: _ModelInputs = next(data_iterator)
    routers = _routers(model) if replay else []
    if replay == "replay":
        _set_replay_targets(routers, inputs, ctx=ctx)
    output = model(
        input_ids=inputs.input_ids,
        position_ids=inputs.position_ids,
        attention_mask=inputs.attention_mask,
        packed_seq_params=inputs.packed_seq_params,
    )
    if replay == "record":
        if inputs.recorded is None:
            config = _gpt_model(model).config
            shape = (*inputs.batch.input_ids.shape, config.num_layers, config.moe_router_topk)
            inputs.recorded = torch.zeros(shape, dtype=torch.long, device=ctx.device)
        _collect_recorded(routers, inputs, ctx=ctx)

    def loss_func(output_tensor: torch.Tensor) -> tuple:
        if outputs == "scores":
            return output_tensor.new_zeros(()), {"scores": _scores(output_tensor, inputs, ctx=ctx)}
        out = _head_outputs(
            output_tensor, inputs, ctx=ctx, outputs=outputs, vocab_size=vocab_size, fused=fused
        )
        if loss_fn is None:
            return output_tensor.new_zeros(()), {name: getattr(out, name) for name in _OUTPUT_NAMES[outputs]}
        loss, metrics = loss_fn(out, inputs.batch.to(output_tensor.device))
        # Megatron divides by the number of micro-batches and averages gradients over DP×CP; the
        # loss already carries global denominators, so undo both (one token count per micro-batch).
        reduced = {"loss": loss.detach(), **{k: torch.as_tensor(v).detach() for k, v in metrics.items()}}
        return loss * loss_scale, torch.tensor(1, dtype=torch.int), reduced

    return output, loss_func


def _routers(model: torch.nn.Module) -> list[tuple[int, Any]]:
    """(0-based global layer, RouterReplay) of each MoE router in ``model`` (this stage's layers)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [
        (m.layer_number - 1, m.router_replay)
        for m in model.modules()
        if isinstance(m, TopKRouter) and m.router_replay is not None
    ]


def _router_order(inputs: _ModelInputs, *, ctx: ParallelContext) -> tuple[torch.Tensor, int, int]:
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


def _set_replay_targets(routers: list, inputs: _ModelInputs, *, ctx: ParallelContext) -> None:
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


def _collect_recorded(routers: list, inputs: _ModelInputs, *, ctx: ParallelContext) -> None:
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


def _arm_routers(chunks: list[torch.nn.Module], replay: Replay | None) -> list:
    """Set the routers' replay action for a pass (``record`` here; ``replay`` per micro-batch)."""
    routers = [r for chunk in chunks for r in _routers(chunk)] if replay else []
    if replay and not routers and _any_moe_config(chunks):
        raise ValueError("routing replay: no router of this model has a RouterReplay")
    for _, router in routers:
        router.clear_indices()
        if replay == "record":
            router.set_router_replay_action(_action("RECORD"))
    return routers


def _any_moe_config(chunks: list[torch.nn.Module]) -> bool:
    return any(getattr(_gpt_model(c).config, "num_moe_experts", None) for c in chunks)


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
        heads = [m for m in map(_gpt_model, chunks) if getattr(m, "output_layer", None) is not None]
        if heads:  # else not a last pipeline stage: nothing to fuse here
            (model,) = heads  # one last stage (the VPP chunk with the head)
            swapped = (model, model.output_layer)
            model.output_layer = _HiddenStatesOut(model.output_layer)
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
    fused: tuple[FusedHead, _HiddenStatesOut] | None = None,
    router_replay: Replay | None = None,
) -> ForwardResult:
    if outputs not in _OUTPUT_NAMES:
        raise ValueError(f"outputs={outputs!r}; expected one of {', '.join(_OUTPUT_NAMES)}")
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
    micro = _micro_batches(batch, splits, ctx=ctx, batching=batching)
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
    routers = _arm_routers(chunks, router_replay)
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
    routes = _gather_routes(micro, splits, batch, ctx=ctx) if router_replay == "record" else None
    if not forward_only:
        return ForwardResult(output=ModelOutput(routed_experts=routes), metrics=_sum_metrics(stored, ctx=ctx))
    gathered = _gather_outputs(stored, splits, batch, ctx=ctx, outputs=outputs)
    scores = gathered.pop("scores", None)
    return ForwardResult(output=ModelOutput(**gathered, routed_experts=routes), metrics={}, scores=scores)


def _gather_routes(
    micro: list[_ModelInputs], splits: list[list[int]], batch: TokenBatch, *, ctx: ParallelContext
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


def _micro_batches(
    batch: TokenBatch, splits: list[list[int]], *, ctx: ParallelContext, batching: MicroBatching
) -> list[_ModelInputs]:
    """The micro-batches of ``batch`` in the model's layout (packed rows or padded rows)."""
    pad_to = ctx.tp_size if ctx.parallel.sequence_parallel else 1
    # The interleaved (VPP) schedule cannot exchange micro-batches of different shapes between
    # stages: pad every packed row to the longest one.
    lengths = batch.attention_mask.sum(1).tolist()
    if ctx.cp_size > 1:
        lengths = [_cp_padded(n, ctx.cp_size) for n in lengths]
    min_length = max(sum(lengths[i] for i in idx) for idx in splits) if ctx.vpp_size else 0
    if ctx.vpp_size and not batching.use_remove_padding and len({len(i) for i in splits}) > 1:
        raise ValueError(
            "virtual pipeline parallelism without use_remove_padding needs equal micro-batch sizes"
        )
    return [
        _prepare(
            batch.select(idx),
            pack=batching.use_remove_padding,
            pad_to_multiple=pad_to,
            min_length=min_length,
            device=ctx.device,
            cp_size=ctx.cp_size,
            cp_rank=ctx.cp_rank,
        )
        for idx in splits
    ]


def _gather_outputs(
    stored: list[dict],
    splits: list[list[int]],
    batch: TokenBatch,
    *,
    ctx: ParallelContext,
    outputs: Outputs,
) -> dict[str, torch.Tensor]:
    """Restore sample order on the last stage and broadcast to the other pipeline stages."""
    names = _OUTPUT_NAMES[outputs]
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
