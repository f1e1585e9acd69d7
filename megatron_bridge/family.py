"""What one model family is: its mapping table, the architecture facts a model builder needs, its
tiny test preset.

Contract:
- ``ModelFamily`` is frozen data: the HF ``model_types`` it serves, its mapping rows (canonical
  Megatron names ↔ HF checkpoint names), ``facts`` — a pure function from a concrete model's HF
  config (a ``PretrainedConfig`` or the dict of its ``config.json``) to ``ArchitectureFacts`` — and
  ``tiny_preset``, the HF-config keyword arguments of the family's tiny random test model.
- ``ArchitectureFacts`` says what differs between families in words of the architecture (biases,
  norms, tying, experts and their router), not in any builder's vocabulary: the Megatron builder
  (``rltrain/megatron/model_config.py``) translates it into ``TransformerConfig`` fields, and nothing else
  in the trainer asks which family a model belongs to.
- A ``config.json`` may leave out any key whose value is transformers' default for its
  ``model_type`` (``AutoConfig`` fills it in; hand-written and trimmed configs do this). Each family
  declares those defaults for the keys the bridge reads (``hf_defaults``), and every reader goes
  through ``hf_config.config_value``, which applies them: the bridge reads such a config as
  transformers does, without importing transformers.
- Each family lives in one file under ``megatron_bridge/models/``; ``megatron_bridge.registry``
  finds it by ``model_type``. A family's causal LM and its ``*ForSequenceClassification`` model share
  the ``model_type`` (and so the family): they differ only in the head (``score_head``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from megatron_bridge.mappings import AnyMapping


@dataclass(frozen=True)
class MoEFacts:
    """A decoder whose MLPs are routed experts (every layer unless ``dense_layers`` says otherwise)."""

    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts each token is routed to."""
    ffn_hidden_size: int
    """Intermediate size of one routed expert's SwiGLU MLP."""
    renormalize_topk: bool
    """The top-k router probabilities are renormalized to sum to one (Mixtral; Qwen-MoE with
    ``norm_topk_prob``), which equals a softmax over the top-k logits; otherwise each chosen expert
    keeps its probability under the softmax over all experts (Qwen2-MoE)."""
    aux_loss_coeff: float
    """Weight of the load-balancing auxiliary loss (0: none)."""
    shared_expert_ffn_hidden_size: int = 0
    """Intermediate size of the shared expert every token also passes through (0: no shared expert)."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by a learned per-token sigmoid gate (Qwen2-MoE)."""
    dense_layers: tuple[int, ...] = ()
    """Layer numbers whose MLP is a dense MLP instead of experts (empty: every layer is MoE)."""
    score_function: str = "softmax"
    """``"softmax"`` over the router logits, or ``"sigmoid"`` of each logit (DeepSeek-V3)."""
    num_groups: int | None = None
    """Experts form this many groups; a token picks ``group_topk`` groups first (DeepSeek's ``n_group``)."""
    group_topk: int | None = None
    """Groups each token may route into (``topk_group``)."""
    topk_scaling_factor: float | None = None
    """The chosen experts' weights are multiplied by this (``routed_scaling_factor``)."""
    expert_bias: bool = False
    """A per-expert bias added to the scores for choosing experts only, not for their weights
    (DeepSeek-V3's ``e_score_correction_bias``; aux-loss-free load balancing)."""
    biased_experts: bool = False
    """Every expert's linears and the router have biases (GPT-OSS); an expert's output bias is scaled
    by its routing weight with the rest of its output."""


@dataclass(frozen=True)
class MLAFacts:
    """Multi-latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank latents."""

    q_lora_rank: int | None
    """Rank of the query latent (``None``: a direct query projection)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    """Per-head query/key dimensions without RoPE."""
    qk_rope_head_dim: int
    """Per-head query/key dimensions with RoPE (the key's are shared by all heads)."""
    v_head_dim: int
    latent_norm_eps: float = 1e-6
    """Epsilon of the latent norms (HF's ``q_a_layernorm`` / ``kv_a_layernorm``): transformers builds
    them with its RMSNorm's default 1e-6 whatever ``rms_norm_eps`` says (Moonlight: 1e-5)."""


@dataclass(frozen=True)
class ArchitectureFacts:
    """The architecture choices of one model beyond its shapes (which the HF config states directly)."""

    qkv_bias: bool
    """The query, key and value projections have biases (the output projection never has one)."""
    qk_norm: bool
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    tie_word_embeddings: bool
    """The LM head reuses the input embedding matrix."""
    moe: MoEFacts | None = None
    """Routed experts; ``None`` for a dense decoder."""
    mla: MLAFacts | None = None
    """Multi-latent attention instead of (grouped-query) multi-head attention."""
    rotary_fraction: float = 1.0
    """Fraction of each head's dimensions RoPE rotates: the first ones, rotate-half style, the rest
    pass through (GLM-4.5's ``partial_rotary_factor`` 0.5; Megatron's ``rotary_percent``)."""
    sliding_window: int | None = None
    """Keys a sliding-window layer's query attends to, itself included (HF's ``sliding_window``:
    query i sees keys i - sliding_window + 1 .. i); ``None``: no sliding-window layer."""
    sliding_layers: tuple[int, ...] = ()
    """Layer numbers (0-based) with sliding-window attention; the others attend to every earlier key."""
    mtp_num_layers: int = 0
    """Multi-token-prediction layers after the decoder (``num_nextn_predict_layers``; DeepSeek-V3)."""
    linear_bias: bool = False
    """Every linear layer has a bias: the query/key/value and output projections, the MLPs or experts
    and the router (GPT-OSS; Megatron's ``add_bias_linear``). The LM head has none."""
    attention_sinks: bool = False
    """A learned logit per attention head joins each softmax's denominator and contributes no value
    (GPT-OSS's ``sinks``; Megatron's ``softmax_type='learnable'``)."""
    clamped_glu_limit: float | None = None
    """GPT-OSS's gated unit ``(clamp(up, -c, c) + 1) · g · sigmoid(1.702 · g)``, g = ``clamp(gate,
    max=c)``, with c this limit (``swiglu_limit``); ``None``: SwiGLU ``silu(gate) · up``."""


@dataclass(frozen=True)
class ModelFamily:
    """Everything of one model family: names, architecture facts, tiny test preset."""

    name: str
    model_types: tuple[str, ...]
    """HF ``model_type`` values this family serves."""
    mappings: tuple[AnyMapping, ...]
    """Mapping rows in canonical Megatron names; their order is the order of a layer's tensors."""
    facts: Callable[[Any], ArchitectureFacts]
    """HF config (``PretrainedConfig`` or ``config.json`` dict) → the model's ``ArchitectureFacts``."""
    tiny_preset: Mapping[str, Any]
    """HF-config keyword arguments of the tiny random test model (``vocab_size`` is set by the caller)."""
    score_head: str = "score.weight"
    """HF name of the scalar head of the family's ``*ForSequenceClassification`` checkpoint
    ([num_labels, hidden], no bias), which a reward model's ``output_layer.weight`` loads."""
    hf_defaults: Mapping[str, Any] = field(default_factory=dict)
    """The field defaults of the transformers config class of ``model_types`` (its
    ``configuration_<model>.py``) for every config key the bridge reads that the class defines: what
    a ``config.json`` that leaves the key out means (``config_value`` applies them). ``None`` where
    the class derives the value from other keys (``num_key_value_heads``: ``num_attention_heads``);
    the readers derive it the same way. ``tests/unit/bridge/test_trimmed_hf_configs.py`` checks the
    table against the installed transformers, and that no key the bridge reads is missing."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiny_preset", MappingProxyType(dict(self.tiny_preset)))
        object.__setattr__(self, "hf_defaults", MappingProxyType(dict(self.hf_defaults)))
