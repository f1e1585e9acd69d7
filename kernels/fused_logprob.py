"""Fused LM head + per-token log-probabilities and entropy over a vocab-parallel output layer.

Contract: ``fused_logprobs_entropy(hidden, weight, targets, ...)`` takes the final hidden states
``hidden: [..., hidden_size]`` (the same on every TP rank, as Megatron's column-parallel output layer
sees them with sequence parallelism off), this rank's LM-head shard ``weight: [vocab / tp, hidden_size]``
(rank r holds rows [r·V/tp, (r+1)·V/tp) of the vocabulary padded to a multiple of TP) and the
full-vocabulary ``targets: [...]``, and returns ``(logprobs, entropy)``, each ``[...]`` float32 (float64
for float64 inputs), equal on every TP rank to

    z = hidden @ weight_full[:vocab_size].T / temperature
    logprobs = log_softmax(z).gather(targets),   entropy = -(softmax(z) · log_softmax(z)).sum(-1)

i.e. to ``rltrain.megatron.logprobs.vocab_parallel_logprobs_entropy`` applied to the materialised
``hidden @ weight.T / temperature``. Rows of ``weight`` at or beyond ``vocab_size`` (padding) take no
part and get a zero gradient; a target outside this rank's real rows contributes nothing here (one
outside the whole real vocabulary gets ``logprobs = -logsumexp(z)``, as in the unfused path).

Memory: the logits exist only ``chunk_size`` tokens at a time (``[chunk, vocab/tp]``, computed by a
matmul in the input dtype and upcast per chunk); what crosses the chunks and the TP ranks are [tokens]
vectors (per-rank max, sum of exponentials, sum of p·logit, target logit), reduced with one MAX and
one SUM all-reduce on ``tp_group`` after the last chunk. Backward recomputes each chunk's logits.

Gradients flow to ``hidden`` and ``weight`` for both outputs. ``grad_weight`` is this rank's shard,
accumulated over chunks in float32. ``grad_hidden`` of one rank covers only its vocabulary shard;
with ``all_reduce_grad_hidden=True`` (the default) the op sums it over ``tp_group``, which is what
Megatron's ``ColumnParallelLinear`` does for its input gradient with sequence parallelism off, so the
caller passes the gradient on unchanged. With sequence parallelism on, the caller gathers the hidden
states with Megatron's ``gather_from_sequence_parallel_region`` (whose backward reduce-scatters the
partial gradients) and passes ``all_reduce_grad_hidden=False``.

``impl="torch"`` is the reference and the CPU path; ``impl="triton"`` (CUDA tensors, the ``triton``
package) runs the same per-chunk statistics and softmax gradient as Triton kernels
(``kernels/triton_logprob.py``) around the same matmuls and reductions.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist

CHUNK_ELEMENTS = 1 << 26
"""Logit elements per chunk when ``chunk_size`` is None (256 MiB of float32 for one chunk)."""


def chunk_stats(logits: torch.Tensor, local_targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits: [chunk, valid] (this rank's real columns; may be overwritten), local_targets: [chunk]
    (-1: not on this rank) → [4, chunk] in float32 (float64 for float64 logits): per row, with
    z = logits / temperature, m = max z, a = Σ exp(z - m), b = Σ exp(z - m)·(z - m), t = z[target]
    (0 when not here)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)).div_(temperature)
    m = z.max(dim=-1).values
    here = local_targets >= 0
    t = z.gather(-1, local_targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * here
    z.sub_(m.unsqueeze(-1))
    e = z.exp()
    a = e.sum(-1)
    b = e.mul_(z).sum(-1)
    return torch.stack([m, a, b, t])


def chunk_grad(
    logits: torch.Tensor,
    local_targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """d(loss)/d(logits) for one chunk, [chunk, valid] in ``logits.dtype`` (``logits`` may be
    overwritten; lse, entropy and the output gradients are [chunk] in the compute dtype).

    With z = logits / T, log p = z - lse: d logprob/dz = onehot - p, d entropy/dz = -p (log p + H);
    the result carries the 1/T of dz/dlogits.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    log_p = z.div_(temperature).sub_(lse.unsqueeze(-1))
    p = log_p.exp()
    grad = log_p.add_(entropy.unsqueeze(-1)).mul_(p).mul_(-grad_entropy.unsqueeze(-1))
    grad.sub_(p.mul_(grad_logprobs.unsqueeze(-1)))
    del p
    here = local_targets >= 0
    grad.scatter_add_(-1, local_targets.clamp(min=0).unsqueeze(-1), (grad_logprobs * here).unsqueeze(-1))
    return grad.div_(temperature).to(logits.dtype)


class ChunkOps(NamedTuple):
    """The per-chunk pieces an implementation provides (signatures of ``chunk_stats``, ``chunk_grad``)."""

    stats: Callable[..., torch.Tensor]
    grad: Callable[..., torch.Tensor]


TORCH_OPS = ChunkOps(chunk_stats, chunk_grad)


def _combine(stats: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[4, tokens] per-rank (m, a, b, t) → (logprobs, entropy, lse), each [tokens], over ``group``."""
    m, a, b, t = stats
    top = m.clone()
    if group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    # A rank without real columns has m = -inf and a = b = 0: it contributes nothing (no -inf · 0).
    has = a > 0
    shift = torch.where(has, m - top, torch.zeros_like(m))
    scale = shift.exp() * has
    total = torch.stack([scale * a, scale * (b + shift * a), t])
    if group is not None:
        dist.all_reduce(total, group=group)
    sum_exp, sum_exp_shifted, target = total
    log_z = sum_exp.log()
    return target - top - log_z, log_z - sum_exp_shifted / sum_exp, top + log_z


def _chunks(tokens: int, chunk_size: int) -> list[slice]:
    """At most ``chunk_size`` tokens each, of balanced sizes: no short tail chunk (CPU BLAS GEMMs with a
    handful of rows accumulate over the vocabulary an order of magnitude less accurately)."""
    num = -(-tokens // chunk_size)
    return [slice(tokens * i // num, tokens * (i + 1) // num) for i in range(num)]


class _FusedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        local_targets: torch.Tensor,
        num_valid: int,
        temperature: float,
        chunk_size: int,
        ops: ChunkOps,
        group: Any,
        all_reduce_grad_hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = hidden.size(0)
        compute = torch.promote_types(hidden.dtype, torch.float32)
        stats = torch.zeros(4, tokens, dtype=compute, device=hidden.device)
        stats[0] = float("-inf")
        real = weight[:num_valid]
        if num_valid:
            for rows in _chunks(tokens, chunk_size):
                logits = torch.matmul(hidden[rows], real.t())
                stats[:, rows] = ops.stats(logits, local_targets[rows], temperature)
                del logits
        logprobs, entropy, lse = _combine(stats, group)
        ctx.save_for_backward(hidden, weight, local_targets, lse, entropy)
        ctx.num_valid, ctx.temperature, ctx.chunk_size = num_valid, temperature, chunk_size
        ctx.ops, ctx.group, ctx.all_reduce_grad_hidden = ops, group, all_reduce_grad_hidden
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor) -> tuple:
        hidden, weight, local_targets, lse, entropy = ctx.saved_tensors
        num_valid, chunk_size = ctx.num_valid, ctx.chunk_size
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        compute = lse.dtype
        grad_logprobs, grad_entropy = grad_logprobs.to(compute), grad_entropy.to(compute)
        grad_hidden = (
            torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if want_hidden else None
        )
        grad_weight = torch.zeros(weight.shape, dtype=compute, device=weight.device) if want_weight else None
        real = weight[:num_valid]
        tokens = hidden.size(0)
        for rows in _chunks(tokens, chunk_size) if num_valid and (want_hidden or want_weight) else []:
            logits = torch.matmul(hidden[rows], real.t())
            grad = ctx.ops.grad(
                logits,
                local_targets[rows],
                lse[rows],
                entropy[rows],
                grad_logprobs[rows],
                grad_entropy[rows],
                ctx.temperature,
            )
            del logits
            if want_hidden:
                torch.mm(grad, real, out=grad_hidden[rows])
            if want_weight:
                if grad.dtype == compute:
                    grad_weight[:num_valid].addmm_(grad.t(), hidden[rows])
                else:
                    grad_weight[:num_valid] += torch.mm(grad.t(), hidden[rows])
        if want_hidden and ctx.all_reduce_grad_hidden and ctx.group is not None:
            dist.all_reduce(grad_hidden, group=ctx.group)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _ops(impl: str, hidden: torch.Tensor) -> ChunkOps:
    if impl == "torch":
        return TORCH_OPS
    if impl != "triton":
        raise ValueError(f"impl: {impl!r} is not one of 'torch', 'triton'")
    has_triton = importlib.util.find_spec("triton") is not None
    if not has_triton or not hidden.is_cuda:
        raise RuntimeError(
            f"impl='triton' needs CUDA tensors and the triton package (hidden is on {hidden.device}, "
            f"triton is {'installed' if has_triton else 'not installed'})"
        )
    from kernels import triton_logprob

    return ChunkOps(triton_logprob.chunk_stats, triton_logprob.chunk_grad)


def _check(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int | None,
    world: int,
    temperature: float,
    chunk_size: int | None,
) -> None:
    if hidden.dim() < 1 or tuple(hidden.shape[:-1]) != tuple(targets.shape):
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be targets {tuple(targets.shape)} + [hidden_size]"
        )
    if weight.dim() != 2 or weight.size(1) != hidden.size(-1):
        raise ValueError(f"weight {tuple(weight.shape)} must be [vocab / tp, {hidden.size(-1)}]")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(
            f"weight ({weight.dtype}, {weight.device}) and hidden ({hidden.dtype}, {hidden.device}) differ"
        )
    if vocab_size is not None and not 0 < vocab_size <= weight.size(0) * world:
        raise ValueError(f"vocab_size {vocab_size} is not in (0, {weight.size(0) * world}] (padded vocab)")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (or None), got {chunk_size}")


def fused_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Any = None,
    tp_rank: int = 0,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    all_reduce_grad_hidden: bool = True,
    impl: Literal["torch", "triton"] = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden: [..., hidden_size], weight: [vocab/tp, hidden_size] (this rank's shard), targets: [...]
    → (logprobs [...], entropy [...]) in float32, of ``hidden @ weight.T / temperature`` (module
    docstring).

    ``tp_group=None`` (or a group of one) means ``weight`` holds the whole (padded) vocabulary.
    ``vocab_size``: the real vocabulary when the model's is padded; None means no padding.
    ``chunk_size``: the most tokens whose logits exist at once (the tokens are split into equal
    chunks); None picks ``CHUNK_ELEMENTS // (vocab/tp)``.
    ``all_reduce_grad_hidden``: sum the input gradient over ``tp_group`` (see the module docstring).
    """
    world = dist.get_world_size(tp_group) if tp_group is not None else 1
    if world == 1:
        tp_group = None
    _check(hidden, weight, targets, vocab_size, world, temperature, chunk_size)
    ops = _ops(impl, hidden)
    local_vocab = weight.size(0)
    vocab_start = tp_rank * local_vocab
    real = vocab_size if vocab_size is not None else local_vocab * world
    num_valid = max(0, min(local_vocab, real - vocab_start))
    local = targets.long() - vocab_start
    local_targets = torch.where((local >= 0) & (local < num_valid), local, torch.full_like(local, -1))
    chunk = chunk_size if chunk_size is not None else max(1, CHUNK_ELEMENTS // max(local_vocab, 1))
    logprobs, entropy = _FusedLogprobEntropy.apply(
        hidden.reshape(-1, hidden.size(-1)),
        weight,
        local_targets.reshape(-1),
        num_valid,
        float(temperature),
        chunk,
        ops,
        tp_group,
        all_reduce_grad_hidden,
    )
    return logprobs.view(targets.shape), entropy.view(targets.shape)
