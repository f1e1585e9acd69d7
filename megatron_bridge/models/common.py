"""Mapping rows shared by the Llama-style families (canonical Megatron names, HF checkpoint names).

Contract: each helper returns a tuple of mappings; a family table is the concatenation of the
pieces it uses, so every row of every family is visible in one place here or in its own file.
"""

from __future__ import annotations

from megatron_bridge.mappings import (
    QKV,
    AnyMapping,
    GatedMLP,
    PerExpert,
    Replicated,
    RowParallel,
    VocabParallel,
)

L = "decoder.layers.*."
H = "model.layers.*."


def embeddings_and_head() -> tuple[AnyMapping, ...]:
    """Embedding, final norm and output layer (the output row is dropped for tied embeddings)."""
    return (
        VocabParallel("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        Replicated("decoder.final_layernorm.weight", "model.norm.weight"),
        VocabParallel("output_layer.weight", "lm_head.weight"),
    )


def attention(*, bias: bool = False, qk_norm: bool = False) -> tuple[AnyMapping, ...]:
    """Pre-attention norm, fused QKV (optionally with bias and per-head q/k norms), output projection."""
    rows: list[AnyMapping] = [
        Replicated(L + "input_layernorm.weight", H + "input_layernorm.weight"),
        QKV(
            L + "self_attention.linear_qkv.weight",
            H + "self_attn.q_proj.weight",
            k=H + "self_attn.k_proj.weight",
            v=H + "self_attn.v_proj.weight",
        ),
        RowParallel(L + "self_attention.linear_proj.weight", H + "self_attn.o_proj.weight"),
        Replicated(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight"),
    ]
    if bias:
        rows.append(
            QKV(
                L + "self_attention.linear_qkv.bias",
                H + "self_attn.q_proj.bias",
                k=H + "self_attn.k_proj.bias",
                v=H + "self_attn.v_proj.bias",
            )
        )
    if qk_norm:
        rows.append(Replicated(L + "self_attention.q_layernorm.weight", H + "self_attn.q_norm.weight"))
        rows.append(Replicated(L + "self_attention.k_layernorm.weight", H + "self_attn.k_norm.weight"))
    return tuple(rows)


def gated_mlp(megatron_prefix: str, hf_prefix: str) -> tuple[AnyMapping, ...]:
    """A SwiGLU MLP with HF names ``gate_proj``/``up_proj``/``down_proj`` under ``hf_prefix``."""
    return (
        GatedMLP(
            megatron_prefix + "linear_fc1.weight",
            hf_prefix + "gate_proj.weight",
            up=hf_prefix + "up_proj.weight",
        ),
        RowParallel(megatron_prefix + "linear_fc2.weight", hf_prefix + "down_proj.weight"),
    )


def experts(*, hf_expert: str, gate: str, up: str, down: str) -> tuple[AnyMapping, ...]:
    """Per-expert SwiGLU tensors; ``hf_expert`` is the HF prefix with (layer, expert) wildcards."""
    m = L + "mlp.experts.local_experts.*."
    return (
        PerExpert(GatedMLP(m + "linear_fc1.weight", hf_expert + gate, up=hf_expert + up)),
        PerExpert(RowParallel(m + "linear_fc2.weight", hf_expert + down)),
    )
