"""Verification pieces: a probe batch, Megatron logits gathered over TP/PP, HF reference logits and
their comparison in the checkpoint's dtype.

Contract: ``megatron_logits`` is collective over all ranks of ``ctx`` (no virtual pipeline) and
returns ``[batch, seq, vocab_size]`` logits (as fp32) on rank ``dst`` (None elsewhere), the padded
vocabulary rows dropped. Pipeline stages hand activations on with plain point-to-point sends; the
model chunks are called directly (no Megatron import here). ``hf_logits`` runs transformers in a
given dtype. ``compare_logits`` compares like with like: Megatron's logits, computed in the
checkpoint's dtype, against transformers' in that same dtype, within ``atol`` plus
``ROUNDING_NOISE_FACTOR`` times the rounding noise of that dtype *for this model*: how far
transformers' own logits move when run in the dtype instead of the next wider one (fp32 for bf16
and fp16, fp64 for fp32). So a correct conversion passes whatever the dtype, depth and logit scale,
while an error larger than the dtype's own rounding fails (a routed model may have
``ROUTING_FLIP_FRACTION`` of its tokens beyond it: expert choices flipped at near-ties). The wider reference holds twice the
checkpoint's bytes on rank 0 for the moment of one forward. The probe rows are
``PROBE_TOKENS`` long (capped at the model's context): a dropped or wrong RoPE scaling changes the
rotation of far positions only, and at 16 tokens it hides under bf16 rounding. With YaRN
(``rope_type: yarn``) they reach ``PROBE_TOKENS_PAST_ORIGINAL`` tokens beyond its
``original_max_position_embeddings`` (``probe_tokens``), where the scaled rotation takes over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_bridge.hf_config import load_hf_config

PROBE_TOKENS = 256
"""Tokens per probe row (fewer when the model's context is shorter)."""

ROUNDING_NOISE_FACTOR = 3.0
"""Megatron and transformers each deviate from the fp32 function by about the reference's rounding
noise, so their difference stays within about twice it (measured 0.5-1.9 times it in bf16 over two
seeds of each tiny family, MoE included, whose noise is larger as rounding flips expert choices);
three leaves room without hiding an error larger than the rounding."""


ROUTING_FLIP_FRACTION = 0.01
"""In a mixture-of-experts model run in bf16, a token whose top-k boundary is a near-tie (two
experts' scores within rounding of each other) can take another expert in Megatron than in
transformers; that token's logits then differ by several times the rounding noise while every other
token agrees (seen: GLM-4.5-Air's tiny model in bf16, one of 512 probe tokens at 4.4 times the noise,
the other 511 within 1.1 times it; Megatron's logits of that token are as far from the fp32 ones).
Up to this fraction of a routed model's probe tokens (at least one) may exceed the tolerance; a
wrong conversion moves far more of them (a dropped or permuted expert: every token routed to it,
about top-k / experts of them per layer; a wrong RoPE scaling: every far position)."""


PROBE_TOKENS_PAST_ORIGINAL = 32
"""With YaRN, probe rows end this many tokens past ``original_max_position_embeddings`` (if longer
than ``PROBE_TOKENS``; capped at the model's context)."""


def probe_tokens(config: Any) -> int:
    """Tokens per probe row for the HF ``config``: ``PROBE_TOKENS``, or with YaRN up to
    ``PROBE_TOKENS_PAST_ORIGINAL`` past its pre-training length; never beyond the model's context."""
    from megatron_bridge.hf_config import config_value

    context = config.max_position_embeddings
    rope = config_value(config, "rope_parameters", "rope_scaling", default=None) or {}
    tokens = PROBE_TOKENS
    if rope.get("rope_type", rope.get("type")) == "yarn":
        original = rope.get("original_max_position_embeddings") or context
        tokens = max(tokens, original + PROBE_TOKENS_PAST_ORIGINAL)
    return min(tokens, context)


WIDER = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.float32: torch.float64}
"""The dtype whose reference logits measure a dtype's rounding noise."""


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def probe_batch(
    vocab_size: int,
    *,
    batch: int = 2,
    seq: int = PROBE_TOKENS,
    max_positions: int | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """Deterministic token ids [batch, min(seq, max_positions)] (no padding)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, min(seq, max_positions or seq)), generator=gen)


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
def megatron_logits_and_mtp(
    chunks: list[torch.nn.Module], ctx: Any, input_ids: torch.Tensor, *, vocab_size: int, dst: int = 0
) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
    """``megatron_logits`` and, from the same forward, the multi-token-prediction layers' logits on
    rank ``dst`` (None elsewhere), collective: per MTP layer ``k``, ``[batch, seq - 1 - k,
    vocab_size]`` (fp32) — at
    position ``i`` the prediction of token ``i + k + 2`` from the main model's hidden state ``i``
    and token ``i + k + 1`` (the positions that have such a token). The last stage runs its
    ``mtp`` block (Megatron-Core's) on the decoder's output with the decoder's own attention mask
    and rotary inputs, then the shared output layer; the TP shards are gathered."""
    model = _unwrap(chunks[0])
    captured: dict[str, Any] = {}

    def keep(module: Any, args: Any, kwargs: dict, output: torch.Tensor) -> None:
        captured.update(kwargs, hidden=output)

    handle = model.decoder.register_forward_hook(keep, with_kwargs=True) if hasattr(model, "mtp") else None
    try:
        main = megatron_logits(chunks, ctx, input_ids, vocab_size=vocab_size, dst=dst)
    finally:
        if handle is not None:
            handle.remove()
    batch, seq = input_ids.shape
    device = getattr(ctx, "device", torch.device("cpu"))
    out = None
    if handle is not None:
        ids = input_ids.to(device)
        positions = torch.arange(seq, device=device).expand(batch, seq)
        hidden = model.mtp(
            input_ids=ids,
            position_ids=positions,
            hidden_states=captured["hidden"],
            attention_mask=captured["attention_mask"],
            rotary_pos_emb=captured.get("rotary_pos_emb"),
            rotary_pos_cos=captured.get("rotary_pos_cos"),
            rotary_pos_sin=captured.get("rotary_pos_sin"),
            embedding=model.embedding,
        )
        weight = (
            model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        )
        out = []
        for k, part in enumerate(hidden.chunk(1 + len(model.mtp.layers), dim=0)[1:]):
            logits, _ = model.output_layer(part, weight=weight)
            parts = [torch.empty_like(logits) for _ in range(ctx.tp_size)]
            dist.all_gather(parts, logits.contiguous(), group=ctx.groups.tp)
            full = torch.cat(parts, dim=-1)[..., :vocab_size].float().transpose(0, 1)
            out.append(full[:, : seq - 1 - k].contiguous())
    return main, _to_dst(out, ctx, dst, device)


def _to_dst(out: list[torch.Tensor] | None, ctx: Any, dst: int, device: torch.device) -> list | None:
    """Move the logits list of the one TP/DP rank 0 of the last stage that computed it to ``dst``."""
    mine = int(out is not None and ctx.tp_rank == 0 and ctx.dp_rank == 0)
    flags = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(ctx.world_size)]
    dist.all_gather(flags, torch.tensor([mine], device=device))
    src = next(r for r, f in enumerate(flags) if int(f))
    if src == dst:
        return [t.cpu() for t in out] if ctx.rank == dst else None
    box = [[t.cpu() for t in out] if ctx.rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0] if ctx.rank == dst else None


@torch.no_grad()
def hf_mtp_logits(
    hf_dir: str | Path, input_ids: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """Transformers' multi-token-prediction logits of the checkpoint in ``hf_dir`` in ``dtype``, laid
    out as ``megatron_logits_and_mtp`` returns them: its ``MtpModel`` (the MTP layers read from the
    checkpoint, the main model's embedding and head) fed the main model's final hidden states."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    config = load_hf_config(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, config=config, dtype=dtype, **experts).eval()
    first = config.num_hidden_layers
    # MtpModel finds the MTP tensors by the main model's patterns of keys to ignore, which name the
    # released checkpoint's layers (DeepSeek-V3: 61); name this checkpoint's.
    model._keys_to_ignore_on_load_unexpected = [
        rf"model\.layers\.{first + k}\..*" for k in range(config.num_nextn_predict_layers)
    ]
    mtp = MtpModel.from_pretrained(model).eval()
    hidden = model.model(input_ids=input_ids).last_hidden_state
    seq = input_ids.shape[1]
    out = []
    for k, layer in enumerate(mtp.layers):
        ids = input_ids[:, k + 1 :]
        hidden = hidden[:, : seq - 1 - k]
        # RoPE is relative: positions from 0 give the same attention as the shifted tokens' own
        positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        embeds = mtp.embed_tokens(ids)
        hidden = layer(
            embeds,
            hidden,
            position_embeddings=mtp.rotary_emb(embeds, position_ids=positions),
            position_ids=positions,
            past_key_values=None,
            **mtp.create_masks_for_mtp_layer(k, embeds, None, positions),
        )
        logits = mtp._project_to_logits(hidden)
        out.append(logits if logits.dtype == torch.float64 else logits.float())
    return out


def compare_mtp_logits(
    ours: list[torch.Tensor],
    hf_dir: str | Path,
    input_ids: torch.Tensor,
    *,
    dtype: torch.dtype,
    atol: float,
    flips_allowed: int = 0,
) -> list[LogitsComparison]:
    """``compare_logits`` for each multi-token-prediction layer, against ``hf_mtp_logits``."""
    reference = hf_mtp_logits(hf_dir, input_ids, dtype=dtype)
    wider = hf_mtp_logits(hf_dir, input_ids, dtype=WIDER[dtype]) if dtype in WIDER else [None] * len(ours)
    return [
        compare_against(mine, ref, wide, dtype=dtype, atol=atol, flips_allowed=flips_allowed)
        for mine, ref, wide in zip(ours, reference, wider, strict=True)
    ]


@torch.no_grad()
def hf_logits(
    hf_dir: str | Path, input_ids: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Transformers' logits [batch, seq, vocab] of the checkpoint in ``hf_dir``, computed in ``dtype``
    (returned as fp32; fp64 logits as fp64)."""
    from transformers import AutoModelForCausalLM

    # transformers' grouped expert matmul has no fp64 kernel; its eager loop over experts has.
    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    config = load_hf_config(hf_dir)  # Kimi-K2's kimi_k2 reads as DeepseekV3Config
    model = AutoModelForCausalLM.from_pretrained(hf_dir, config=config, dtype=dtype, **experts).eval()
    logits = model(input_ids=input_ids).logits
    return logits if logits.dtype == torch.float64 else logits.float()


@dataclass(frozen=True)
class LogitsComparison:
    """Megatron's logits against transformers' on one probe batch, both computed in ``dtype``."""

    dtype: torch.dtype
    probe_shape: tuple[int, int]
    """[batch, tokens] of the probe."""
    max_abs_diff: float
    rounding_noise: float
    """max |transformers in ``dtype`` − transformers in the next wider dtype| (0 for fp64)."""
    atol: float
    tolerance: float
    """``atol + ROUNDING_NOISE_FACTOR × rounding_noise``."""
    tokens_beyond: int = 0
    """Probe tokens whose largest logit difference exceeds ``tolerance``."""
    flips_allowed: int = 0
    """How many may (``routing_flips_allowed``; 0 for a dense model)."""

    @property
    def ok(self) -> bool:
        return self.tokens_beyond <= self.flips_allowed

    def describe(self) -> str:
        """One line: what was compared, the difference and the tolerance it is held to (and why)."""
        dtype = _name(self.dtype)
        batch, tokens = self.probe_shape
        bound = f"tolerance {self.tolerance:.3e}" if self.rounding_noise else f"atol {self.atol:g}"
        if self.rounding_noise:
            bound += (
                f" (atol {self.atol:g} + {ROUNDING_NOISE_FACTOR:g} × {self.rounding_noise:.3e}, the most that "
                f"running in {dtype} instead of {_name(WIDER[self.dtype])} moves transformers' own logits)"
            )
        verdict = "<=" if self.max_abs_diff <= self.tolerance else ">"
        line = (
            f"logits vs transformers, both in {dtype} on {batch}×{tokens} tokens: max abs diff "
            f"{self.max_abs_diff:.3e} {verdict} {bound}"
        )
        if self.tokens_beyond and self.flips_allowed:
            line += (
                f"; {self.tokens_beyond} of {batch * tokens} tokens beyond it, at most {self.flips_allowed} "
                "allowed (a routed model: a token whose top-k experts tie within rounding may take another "
                "expert in each implementation)"
            )
        return line


def compare_logits(
    ours: torch.Tensor,
    hf_dir: str | Path,
    input_ids: torch.Tensor,
    *,
    dtype: torch.dtype,
    atol: float,
    flips_allowed: int = 0,
) -> LogitsComparison:
    """Compare ``ours`` (Megatron's logits of ``input_ids``, computed in ``dtype``) with transformers'."""
    reference = hf_logits(hf_dir, input_ids, dtype=dtype)
    wider = hf_logits(hf_dir, input_ids, dtype=WIDER[dtype]) if dtype in WIDER else None
    return compare_against(ours, reference, wider, dtype=dtype, atol=atol, flips_allowed=flips_allowed)


def compare_against(
    ours: torch.Tensor,
    reference: torch.Tensor,
    wider: torch.Tensor | None,
    *,
    dtype: torch.dtype,
    atol: float,
    flips_allowed: int = 0,
) -> LogitsComparison:
    """``ours`` against ``reference`` (transformers in ``dtype``) [batch, tokens, vocab], held to
    ``atol`` plus ``ROUNDING_NOISE_FACTOR`` times the rounding noise ``|reference - wider|`` (``wider``:
    transformers in the next wider dtype; None for fp64, which has no noise term)."""
    noise = 0.0 if wider is None else (reference - wider).abs().max().item()
    tolerance = atol + ROUNDING_NOISE_FACTOR * noise
    per_token = (ours - reference).abs().amax(-1)
    return LogitsComparison(
        dtype=dtype,
        probe_shape=(ours.shape[0], ours.shape[1]),
        max_abs_diff=per_token.max().item(),
        rounding_noise=noise,
        atol=atol,
        tolerance=tolerance,
        tokens_beyond=int((per_token > tolerance).sum()),
        flips_allowed=flips_allowed,
    )


def routing_flips_allowed(*, num_experts: int, tokens: int) -> int:
    """Probe tokens a model may have beyond the tolerance (``ROUTING_FLIP_FRACTION`` of ``tokens``,
    at least one, when it routes tokens to experts; none when it is dense)."""
    return max(1, math.ceil(ROUTING_FLIP_FRACTION * tokens)) if num_experts else 0
