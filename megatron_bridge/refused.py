"""Model types the bridge and the trainer recognize but refuse, each with the one-line reason.

Contract: ``REFUSED`` maps an HF ``model_type`` to the line ``registry.get_family`` raises as
``NotImplementedError`` (so the trainer's config translation and ``rltrain convert`` refuse it
alike, before reading any weight). Each line names what is missing and where it would come from
(the Megatron-Core release that has it, or "no Megatron-Core release"). A refused model type has no
family, no mapping rows and no tiny preset. What was checked, against Megatron-Core 0.16.1's source
(the newest release for Python 3.11):

- ``gpt_oss``: Megatron-Core 0.16.1 has every piece: learnable attention sinks
  (``softmax_type='learnable'``, the sink logit in the softmax denominator as transformers'), the
  alternating 128-token windows (``window_size`` + ``window_attn_skip_freq``), biases on every linear
  and on the router (``add_bias_linear``; an expert's output bias is scaled by its routing weight
  as in transformers), the clamped GLU ``(clamp(up) + 1) * quick_gelu(clamp(gate))``
  (``glu_linear_offset=1``, ``activation_func_clamp_value=7``, ``quick_gelu``'s 1.702 is
  transformers' alpha), top-k-then-softmax routing, and its YaRN (``truncate: false`` is
  ``yarn_correction_range_round_to_int`` with grouped-query attention, built by
  ``rltrain/megatron/yarn.py``). Missing here: the sinks in the CPU attention on packed rows and
  the bridge's rows for the checkpoint's
  fused expert tensors (``gate_up_proj`` [experts, hidden, 2 × ffn] with gate/up interleaved by
  column, ``down_proj`` [experts, ffn, hidden], their biases) and the sinks (split by head under TP).
- ``gemma3_text``: Megatron-Core 0.16.1's ``GPTModel`` has one rotary embedding for all layers
  (Gemma 3's sliding layers use ``rope_local_base_freq``, its full layers ``rope_theta``), its
  ``TransformerLayer`` has no norm after attention or after the MLP (Gemma's
  ``post_attention_layernorm`` / ``post_feedforward_layernorm``) and its embedding has no
  ``sqrt(hidden_size)`` scale. NVIDIA's Megatron-Bridge builds Gemma 3 from its own layer and
  rotary modules on top of Megatron-Core, not from a Megatron-Core option.
"""

from __future__ import annotations

REFUSED: dict[str, str] = {
    "gpt_oss": (
        "gpt_oss is not supported: attention sinks in the CPU attention on packed rows and weight-bridge "
        "rows for its fused interleaved expert tensors, expert biases and sinks are not implemented here "
        "(Megatron-Core 0.16.1 has the rest: softmax_type='learnable', window_size, glu_linear_offset, "
        "activation_func_clamp_value; its YaRN is built)"
    ),
    "gemma3_text": (
        "gemma3_text is not supported: per-layer RoPE bases (rope_local_base_freq on sliding layers), "
        "post-attention and post-feedforward norms and the sqrt(hidden_size) embedding scale are in no "
        "Megatron-Core release through 0.16.1 (GPTModel / TransformerLayer)"
    ),
}
