"""One rank: the packed CPU attention against Megatron's own masked attention on the same inputs."""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron_fixtures import SEED, ensure_process_group

from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.local_spec import PackedDotProductAttention
from rltrain.megatron.parallel import ParallelContext

LENGTHS = [5, 1, 17, 16, 2, 33, 9, 3]
HEADS, GROUPS, DIM = 4, 2, 16


def block_causal_mask(lengths: list[int]) -> torch.Tensor:
    """[1, 1, tokens, tokens], True where forbidden: what the packed path built before."""
    seq_id = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    tokens = seq_id.numel()
    future = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
    return ((seq_id[:, None] != seq_id[None, :]) | future)[None, None]


def _attention_config() -> TransformerConfig:
    # Query-key layer scaling divides the scale by the layer number and multiplies it back in the
    # softmax: the packed path must apply the product.
    return TransformerConfig(
        num_layers=4,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=DIM,
        attention_dropout=0.0,
        apply_query_key_layer_scaling=True,
        attention_softmax_in_fp32=True,
        masked_softmax_fusion=False,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
    )


def _values_and_grads(module: torch.nn.Module, call) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = sum(LENGTHS)
    q = torch.randn(tokens, HEADS, DIM, generator=gen).requires_grad_()
    k, v = (torch.randn(tokens, GROUPS, DIM, generator=gen).requires_grad_() for _ in range(2))
    out = call(module, q, k, v).reshape(tokens, HEADS * DIM)
    (out * torch.randn(out.shape, generator=gen)).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def packed_attention_case() -> dict[str, float]:
    """Scaled max differences (output, dq, dk, dv), the size of the compared gradients, the scale."""
    ensure_process_group()
    ctx = ParallelContext.initialize(ParallelConfig(), seed=SEED)
    try:
        config = _attention_config()
        kwargs = dict(layer_number=3, attn_mask_type=AttnMaskType.causal, attention_type="self")
        new = PackedDotProductAttention(config, **kwargs)
        old = DotProductAttention(config, **kwargs)
        cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=33, max_seqlen_kv=33
        )
        mask = block_causal_mask(LENGTHS)
        got = _values_and_grads(new, lambda m, q, k, v: m(q, k, v, None, packed_seq_params=params))
        ref = _values_and_grads(
            old, lambda m, q, k, v: m(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), mask)
        )
        # Max abs difference, relative to the reference's scale where that exceeds 1 (fp32 keeps ~7 digits).
        result = {
            name: float((a - b).abs().max()) / max(1.0, float(b.abs().max()))
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref)
        }
        result["dq_scale"] = float(ref[1].abs().max())
        result["scale"] = new.softmax_scale * new.scale_mask_softmax.scale
    finally:
        ctx.destroy()
    return result
