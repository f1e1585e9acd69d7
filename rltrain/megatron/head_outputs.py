"""What the last pipeline stage reads off a micro-batch's model output: the actor's per-token
log-probs and entropy, the critic's values, or the reward model's per-sequence scores.

Contract: :func:`head_outputs` picks, for response token j, the output at the position that
predicts it (``ModelInputs.source_index``) and returns a
:class:`~rltrain.algo.token_batch.ModelOutput` [batch, response_len], zero on padding; log-probs and
entropy come from the vocab-parallel logits, or (:class:`FusedHead`) from the final hidden states by
the fused, chunked LM head, the chunk's ``output_layer`` standing in as :class:`HiddenStatesOut` for
the pass. :func:`head_scores` reads the scalar head at each row's last token with attention mask 1
(where an HF sequence classifier pools).

Context parallelism: each rank computes the outputs of the response tokens whose predictor it holds;
a sum over the CP group (gradient passed through unchanged) gives every CP rank the full
[batch, response_len] outputs, so the loss callable sees what it sees at CP = 1 and every CP rank
computes the same loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from rltrain.algo.mtp_loss import mtp_response_mask
from rltrain.algo.token_batch import ModelOutput
from rltrain.megatron.logprobs import vocab_parallel_logprobs_entropy
from rltrain.megatron.micro_batches import ModelInputs
from rltrain.megatron.parallel import ParallelContext

Outputs = Literal["logprobs", "values", "scores"]
OUTPUT_NAMES: dict[str, tuple[str, ...]] = {
    "logprobs": ("logprobs", "entropy"),
    "values": ("values",),
    "scores": ("scores",),
}
"""What a forward pass returns: the LM head's logprobs and entropy, the critic's per-token values,
or the reward model's per-sequence scores."""


@dataclass(frozen=True)
class FusedHead:
    """Log-probs and entropy by the fused, chunked LM head of :mod:`kernels.fused_logprob` instead
    of materialised logits (``model.use_fused_kernels``; ``model.fused_kernel_options``)."""

    impl: Literal["torch", "triton"] = "torch"
    """``torch``: the chunked PyTorch reference (any device); ``triton``: the CUDA kernels."""
    chunk_size: int | None = None
    """Tokens whose logits exist at once; None: the kernel's default (256 MiB of fp32 logits)."""


class HiddenStatesOut(torch.nn.Module):
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


def head_outputs(
    output: torch.Tensor,
    inputs: ModelInputs,
    *,
    ctx: ParallelContext,
    outputs: Outputs,
    vocab_size: int | None,
    fused: tuple[FusedHead, HiddenStatesOut] | None = None,
    mtp_layers: int = 0,
) -> ModelOutput:
    """output: [rows, tokens, vocab/tp] logits (with ``fused``: [rows, tokens, hidden] final hidden
    states) or [rows, tokens, 1] values → ``ModelOutput``. ``mtp_layers`` > 0: ``output`` holds
    [(1 + mtp_layers) × rows, tokens, ...], the main head's then each MTP layer's
    (:func:`~rltrain.megatron.mtp.postprocess_with_mtp`), and ``mtp_logprobs`` is filled."""
    if mtp_layers:
        main, *layers = output.chunk(1 + mtp_layers, dim=0)
        out = head_outputs(main, inputs, ctx=ctx, outputs=outputs, vocab_size=vocab_size, fused=fused)
        out.mtp_logprobs = _mtp_logprobs(layers, inputs, ctx=ctx, vocab_size=vocab_size, fused=fused)
        return out
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


def _mtp_logprobs(
    layers: list[torch.Tensor],
    inputs: ModelInputs,
    *,
    ctx: ParallelContext,
    vocab_size: int | None,
    fused: tuple[FusedHead, HiddenStatesOut] | None,
) -> torch.Tensor:
    """Each MTP layer's output [rows, tokens, ...] → [num_layers, batch, response_len] log-probs of
    the response tokens: layer k reads the position k + 1 before the main head's predictor (a
    sequence's tokens are contiguous in padded and packed rows alike), zero where that is padding."""
    if inputs.held is not None:
        raise NotImplementedError("the MTP loss under context parallelism")
    batch = inputs.batch
    response = batch.input_ids[:, -batch.response_len :].to(layers[0].device)
    attention = batch.attention_mask.to(layers[0].device)
    out = []
    for k, layer in enumerate(layers):
        mask = mtp_response_mask(attention, batch.response_mask.to(layers[0].device), depth=k)
        index = (inputs.source_index - (k + 1)).clamp(min=0) * mask.long()
        picked = layer.reshape(-1, layer.size(-1))[index.flatten()]
        logprobs, _ = _logprobs_entropy(
            picked, response.flatten(), ctx=ctx, vocab_size=vocab_size, fused=fused
        )
        out.append(logprobs.view(index.shape) * mask)
    return torch.stack(out)


def _logprobs_entropy(
    picked: torch.Tensor,
    targets: torch.Tensor,
    *,
    ctx: ParallelContext,
    vocab_size: int | None,
    fused: tuple[FusedHead, HiddenStatesOut] | None,
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
    inputs: ModelInputs,
    *,
    ctx: ParallelContext,
    outputs: Outputs,
    vocab_size: int | None,
    fused: tuple[FusedHead, HiddenStatesOut] | None = None,
) -> ModelOutput:
    """``head_outputs`` on this CP rank's tokens only, summed over the CP group."""
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


def head_scores(output: torch.Tensor, inputs: ModelInputs, *, ctx: ParallelContext) -> torch.Tensor:
    """output: [rows, tokens, 1] scalar head → [batch] float32 at each row's last real token."""
    scores = output.reshape(-1)[inputs.last_index].float()
    if inputs.last_held is None:
        return scores
    return _cp_combine(scores[inputs.last_held], inputs.last_held, ctx.groups.cp)
