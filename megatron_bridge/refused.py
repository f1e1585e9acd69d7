"""Model types the bridge and the trainer recognize but refuse, each with the one-line reason.

Contract: ``REFUSED`` maps an HF ``model_type`` to the line ``registry.get_family`` raises as
``NotImplementedError`` (so the trainer's config translation and ``rltrain convert`` refuse it
alike, before reading any weight). Each line names what is missing and where it would come from
(the Megatron-Core release that has it, or "no Megatron-Core release"). A refused model type has no
family, no mapping rows and no tiny preset. What was checked, against Megatron-Core 0.16.1's source
(the newest release for Python 3.11):

(``gpt_oss`` was refused here until its sinks in the CPU attention and its bridge rows were built:
``megatron_bridge/models/gpt_oss.py``.)

- ``gemma3_text``: Megatron-Core 0.16.1's ``GPTModel`` has one rotary embedding for all layers
  (Gemma 3's sliding layers use ``rope_local_base_freq``, its full layers ``rope_theta``), its
  ``TransformerLayer`` has no norm after attention or after the MLP (Gemma's
  ``post_attention_layernorm`` / ``post_feedforward_layernorm``) and its embedding has no
  ``sqrt(hidden_size)`` scale. NVIDIA's Megatron-Bridge builds Gemma 3 from its own layer and
  rotary modules on top of Megatron-Core, not from a Megatron-Core option.
"""

from __future__ import annotations

REFUSED: dict[str, str] = {
    "gemma3_text": (
        "gemma3_text is not supported: per-layer RoPE bases (rope_local_base_freq on sliding layers), "
        "post-attention and post-feedforward norms and the sqrt(hidden_size) embedding scale are in no "
        "Megatron-Core release through 0.16.1 (GPTModel / TransformerLayer)"
    ),
}
