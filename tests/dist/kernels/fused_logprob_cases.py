"""Rank function for tests/dist/kernels: the fused op at TP=2 against the unfused paths."""

from __future__ import annotations

import torch
import torch.distributed as dist

TOKENS, HIDDEN = 64, 32

CASES = (
    # real vocabulary, padded rows (both ranks), chunk size, temperature
    (49152, 49152, 24, 0.6),
    (151936, 151936, 40, 1.0),
    (151930, 151936, 100, 1.7),  # rank 1 holds 6 padded rows; one chunk
    (30, 64, 24, 0.8),  # rank 1 holds only padding
)


def _full_inputs(rows: int, real: int) -> tuple:
    gen = torch.Generator().manual_seed(rows + real)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen)
    weight = torch.randn(rows, HIDDEN, generator=gen) * (2.0 / HIDDEN**0.5)
    weight[real:] = 5.0  # padding rows would dominate the softmax if they took part
    targets = torch.randint(0, real, (TOKENS,), generator=gen)
    return hidden, weight, targets, torch.randn(TOKENS, generator=gen), torch.randn(TOKENS, generator=gen)


def _fused(hidden, weight, targets, w_lp, w_ent, **kwargs) -> tuple:
    from kernels.fused_logprob import fused_logprobs_entropy

    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = fused_logprobs_entropy(hidden, weight, targets, **kwargs)
    (lp * w_lp + ent * w_ent).sum().backward()
    return lp.detach(), ent.detach(), hidden.grad, weight.grad


def fused_tp_case() -> dict[str, float]:
    """Per case, the largest |difference| of the fused op (tp_group = both ranks) to:
    ``unfused``: this rank's materialised logits → ``vocab_parallel_logprobs_entropy`` on the same
    group, the hidden gradient all-reduced over TP as Megatron's column-parallel layer does;
    ``single``: one rank's full-vocabulary ``log_softmax`` in float64 (the shard's rows of its weight
    gradient); ``partial``: with ``all_reduce_grad_hidden=False``, this rank's own share (the unfused
    hidden gradient before its all-reduce). Also how far this rank's share of the hidden gradient is
    from the whole (relative) and the gradient of its padded rows."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    out: dict[str, float] = {}
    for case in CASES:
        out |= _case(*case)
    return out


def _case(real: int, rows: int, chunk: int, temperature: float) -> dict[str, float]:
    from rltrain.megatron.logprobs import vocab_parallel_logprobs_entropy

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    hidden, weight, targets, w_lp, w_ent = _full_inputs(rows, real)
    shard_rows = slice(rank * rows // world, (rank + 1) * rows // world)
    tag = f"V{real}/{rows}"
    common = {"tp_group": group, "tp_rank": rank, "vocab_size": real, "temperature": temperature}
    inputs = (hidden, weight[shard_rows], targets, w_lp, w_ent)
    lp, ent, grad_h, grad_w = _fused(*inputs, chunk_size=chunk, **common)
    _, _, partial_h, partial_w = _fused(*inputs, chunk_size=chunk, all_reduce_grad_hidden=False, **common)

    u_hidden = hidden.clone().requires_grad_()
    u_weight = weight[shard_rows].clone().requires_grad_()
    u_lp, u_ent = vocab_parallel_logprobs_entropy(
        (u_hidden @ u_weight.t()) / temperature, targets, tp_group=group, tp_rank=rank, vocab_size=real
    )
    (u_lp * w_lp + u_ent * w_ent).sum().backward()
    u_partial_h = u_hidden.grad.clone()
    u_grad_h = u_hidden.grad.clone()
    dist.all_reduce(u_grad_h, group=group)

    s_hidden = hidden.double().requires_grad_()
    s_weight = weight.double().requires_grad_()
    log_p = torch.log_softmax((s_hidden @ s_weight.t())[:, :real] / temperature, dim=-1)
    s_lp = log_p.gather(-1, targets[:, None]).squeeze(-1)
    s_ent = -(log_p.exp() * log_p).sum(-1)
    (s_lp * w_lp.double() + s_ent * w_ent.double()).sum().backward()

    pairs = {
        "unfused logprobs": (lp, u_lp),
        "unfused entropy": (ent, u_ent),
        "unfused grad_hidden": (grad_h, u_grad_h),
        "unfused grad_weight": (grad_w, u_weight.grad),
        "single logprobs": (lp, s_lp),
        "single entropy": (ent, s_ent),
        "single grad_hidden": (grad_h, s_hidden.grad),
        "single grad_weight": (grad_w, s_weight.grad[shard_rows]),
        "partial grad_hidden": (partial_h, u_partial_h),
        "partial grad_weight": (partial_w, grad_w),
    }
    out = {
        f"{tag} {name}": float((a.detach().double() - b.detach().double()).abs().max())
        for name, (a, b) in pairs.items()
    }
    # How far this rank's share is from the whole: the partial/whole checks mean something only then.
    out[f"{tag} share vs whole"] = float((partial_h - grad_h).abs().max() / grad_h.abs().max())
    out[f"{tag} padded rows grad"] = float(grad_w[max(0, real - shard_rows.start) :].abs().sum())
    return out
