"""Model dimensions the mappings need, read from an HF config.

Contract: ``ModelDims.from_hf_config`` reads only standard HF config attributes (it works on a
``PretrainedConfig`` or on the dict of ``config.json``, whose left-out keys mean transformers'
defaults: ``hf_config.config_value``) and raises naming the key for layouts the bridge does not
support (e.g. MoE models that mix dense and MoE layers).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from megatron_bridge.hf_config import config_value


def padded_vocab_size(vocab_size: int, *, divisible_by: int = 128, tp_size: int = 1) -> int:
    """Megatron's padded vocabulary: a multiple of ``divisible_by * tp_size`` (Megatron-LM's rule)."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


SWITCH_KEYS = ("attention_bias", "use_qk_norm")
"""Boolean config keys that add or remove mapping rows (``Mapping.switch``)."""


@dataclass(frozen=True)
class ModelDims:
    """Shapes of one model. ``num_query_groups`` is the number of KV heads (GQA groups)."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    num_experts: int = 0
    dense_layers: tuple[int, ...] = ()
    """Layers of an MoE model whose MLP is dense (DeepSeek's first ``first_k_dense_replace``)."""
    mla_query: str | None = None
    """Multi-latent attention's queries: ``"latent"`` through a query latent (``q_lora_rank`` set),
    ``"direct"`` through one projection (``q_lora_rank: null``); None without MLA."""
    switches: frozenset[str] = frozenset()
    """The keys of ``SWITCH_KEYS`` the config sets true: rows with such a ``switch`` exist."""
    num_mtp_layers: int = 0
    """Multi-token-prediction layers after the decoder (``num_nextn_predict_layers``; DeepSeek-V3,
    GLM-4.5), stored in HF checkpoints as decoder layers ``num_layers + i``."""

    @classmethod
    def from_hf_config(
        cls, config: Any, *, make_vocab_size_divisible_by: int = 128, tp_size: int = 1
    ) -> ModelDims:
        get = lambda *names, default=None: config_value(config, *names, default=default)  # noqa: E731
        model_type = get("model_type")
        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        num_experts = get("num_local_experts", "num_experts", "n_routed_experts", default=0)
        if num_experts and (get("mlp_only_layers") or get("decoder_sparse_step", default=1) != 1):
            raise NotImplementedError(
                f"{model_type}: mlp_only_layers={get('mlp_only_layers')!r} / decoder_sparse_step="
                f"{get('decoder_sparse_step')!r} mix dense and MoE layers; the bridge supports all-MoE decoders"
            )
        vocab = get("vocab_size")
        num_layers = get("num_hidden_layers")
        first_dense = get("first_k_dense_replace", default=0) if num_experts else 0
        if first_dense > num_layers:
            raise ValueError(f"first_k_dense_replace={first_dense} exceeds num_hidden_layers={num_layers}")
        mla = get("kv_lora_rank") is not None
        return cls(
            model_type=model_type,
            num_layers=num_layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=get("num_key_value_heads", default=heads),
            # transformers' DeepSeek configs make head_dim the RoPE part of a head (MLA's rows do not use it)
            head_dim=get("qk_rope_head_dim") if mla else get("head_dim", default=hidden // heads),
            vocab_size=vocab,
            padded_vocab_size=padded_vocab_size(
                vocab, divisible_by=make_vocab_size_divisible_by, tp_size=tp_size
            ),
            tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
            num_experts=int(num_experts),
            dense_layers=tuple(range(first_dense)),
            mla_query=("latent" if get("q_lora_rank") is not None else "direct") if mla else None,
            switches=frozenset(key for key in SWITCH_KEYS if get(key, default=False)),
            num_mtp_layers=int(get("num_nextn_predict_layers", "num_mtp_layers", default=0)),
        )

    def with_padded_vocab(self, padded: int) -> ModelDims:
        if padded < self.vocab_size:
            raise ValueError(f"padded vocab {padded} is smaller than vocab_size {self.vocab_size}")
        return replace(self, padded_vocab_size=padded)
