"""Verification pieces: a probe batch, Megatron logits gathered over TP/PP, HF reference logits.

Contract: ``megatron_logits`` is collective over all ranks of ``ctx`` (no virtual pipeline) and
returns ``[batch, seq, vocab_size]`` fp32 logits on rank ``dst`` (None elsewhere), the padded
vocabulary rows dropped. Pipeline stages hand activations on with plain point-to-point sends; the
model chunks are called directly (no Megatron import here). ``hf_logits`` runs transformers in fp32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def probe_batch(vocab_size: int, *, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    """Deterministic token ids [batch, seq] (no padding)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=gen)


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


@torch.no_grad()
def megatron_logits(
    chunks: list[torch.nn.Module], ctx: Any, input_ids: torch.Tensor, *, vocab_size: int, dst: int = 0
) -> torch.Tensor | None:
    if len(chunks) != 1:
        raise NotImplementedError("logits verification runs without virtual pipeline stages")
    model = _unwrap(chunks[0]).eval()
    device = getattr(ctx, "device", torch.device("cpu"))
    batch, seq = input_ids.shape
    input_ids = input_ids.to(device)
    positions = torch.arange(seq, device=device).expand(batch, seq)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None, None]
    pp_group = ctx.groups.pp
    if ctx.pp_rank > 0:
        hidden = torch.empty(
            seq, batch, model.config.hidden_size, dtype=model.config.params_dtype, device=device
        )
        dist.recv(hidden, dist.get_global_rank(pp_group, ctx.pp_rank - 1))
        model.set_input_tensor(hidden)
    out = model(input_ids, positions, causal)
    if ctx.pp_rank < ctx.pp_size - 1:
        dist.send(out.contiguous(), dist.get_global_rank(pp_group, ctx.pp_rank + 1))
        out = None
    else:
        parts = [torch.empty_like(out) for _ in range(ctx.tp_size)]
        dist.all_gather(parts, out.contiguous(), group=ctx.groups.tp)
        out = torch.cat(parts, dim=-1)[..., :vocab_size].float()
    src_flags = torch.tensor([int(out is not None and ctx.tp_rank == 0 and ctx.dp_rank == 0)], device=device)
    flags = [torch.zeros_like(src_flags) for _ in range(ctx.world_size)]
    dist.all_gather(flags, src_flags)
    src = next(r for r, f in enumerate(flags) if int(f))
    if src == dst:
        return out.cpu() if ctx.rank == dst else None
    if ctx.rank == src:
        dist.send(out.contiguous(), dst)
        return None
    if ctx.rank == dst:
        received = torch.empty(batch, seq, vocab_size, dtype=torch.float32, device=device)
        dist.recv(received, src)
        return received.cpu()
    return None


@torch.no_grad()
def hf_logits(hf_dir: str | Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Transformers' fp32 logits [batch, seq, vocab] of the checkpoint in ``hf_dir``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return model(input_ids=input_ids).logits.float()
