"""YaRN RoPE: a Hugging Face ``rope_parameters`` / ``rope_scaling`` block of ``rope_type: yarn``
translated into what Megatron-Core 0.16.1 reads, for grouped-query and multi-latent attention.

Contract: ``yarn_settings(hf_config, rope, mla=...)`` reads the block with transformers' own
semantics (``modeling_rope_utils._compute_yarn_parameters``) and returns the Megatron settings that
give the same inverse frequencies, the same cos/sin "attention factor" and, for MLA, the same softmax
scale (``modeling_deepseek_v3.yarn_apply_mscale``); a setting Megatron cannot express exactly is
refused at config time naming the key. ``gqa_transformer_config`` builds the ``TransformerConfig``
(with the ``yarn_*`` fields ``GPTModel(position_embedding_type="yarn")`` and the attention's
``_yarn_get_concentration_factor_from_config`` read: 0.16.1's ``TransformerConfig`` declares none of
them, and ``GPTModel`` reads them with ``getattr`` without a default); ``mla_yarn_kwargs`` gives the
``MLATransformerConfig`` fields.

transformers' semantics, field by field:

* ``factor``: when ``None``, ``max_position_embeddings / original_max_position_embeddings``.
* ``original_max_position_embeddings``: when absent, the config's own
  ``original_max_position_embeddings`` attribute, else ``max_position_embeddings`` (what
  ``standardize_rope_params`` fills in).
* ``beta_fast`` / ``beta_slow``: ``or 32`` / ``or 1`` (a 0 means the default).
* the cos/sin factor: ``attention_factor`` when given; else ``get_mscale(factor, mscale) /
  get_mscale(factor, mscale_all_dim)`` when both are truthy, else ``get_mscale(factor)``.
  Megatron computes ``get_mscale(f, mscale) / get_mscale(f, mscale_all_dim)`` always, so the second
  case is ``(mscale, mscale_all_dim) = (1, 0)``: ``get_mscale(f, 0)`` is exactly 1. An explicit
  ``attention_factor`` must equal that derived value.
* ``truncate`` (default true): Megatron's ``yarn_correction_range_round_to_int`` for GQA; MLA's
  rotary embedding always rounds, so ``truncate: false`` with MLA is refused.
* MLA's softmax scale: transformers multiplies ``1/sqrt(q_head_dim)`` by ``get_mscale(factor,
  mscale_all_dim)²`` when ``mscale_all_dim`` is truthy; Megatron always does, and
  ``get_mscale(f, 0) = 1``. With ``mscale`` unset but ``mscale_all_dim`` set, transformers' cos/sin
  factor (``get_mscale(factor)``) and softmax scale need two different ``mscale_all_dim`` in Megatron:
  refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
from megatron.core.transformer import TransformerConfig

from megatron_bridge.hf_config import config_value


@dataclass(frozen=True)
class YarnSettings:
    """Megatron's YaRN settings equal to one HF ``rope_type: yarn`` block."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float
    truncate: bool

    @property
    def attention_factor(self) -> float:
        """The factor on cos and sin (Megatron's "concentration factor")."""
        return _get_mscale(self.factor, self.mscale) / _get_mscale(self.factor, self.mscale_all_dim)

    @property
    def softmax_mscale(self) -> float:
        """MLA's softmax scale is ``softmax_mscale² / sqrt(q_head_dim)``."""
        return _get_mscale(self.factor, self.mscale_all_dim)


def _get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_settings(hf_config: Any, rope: dict, *, mla: bool) -> YarnSettings:
    """Megatron's settings for the ``rope_type: yarn`` block ``rope`` of ``hf_config``; raises
    ``NotImplementedError`` naming the key where Megatron-Core 0.16.1 cannot express it exactly."""
    model_type = hf_config.model_type
    where = f"{model_type}: rope_parameters"
    original = rope.get("original_max_position_embeddings") or config_value(
        hf_config, "original_max_position_embeddings", default=hf_config.max_position_embeddings
    )
    factor = rope.get("factor")
    if factor is None:
        if mla:
            # transformers' MLA softmax scale reads the factor itself (and fails without it).
            raise NotImplementedError(
                f"{where}.factor is missing (YaRN with multi-latent attention needs it)"
            )
        factor = hf_config.max_position_embeddings / original
    partial = float(
        rope.get("partial_rotary_factor", config_value(hf_config, "partial_rotary_factor", default=1.0))
    )
    if partial != 1.0 and not mla:
        raise NotImplementedError(
            f"{where}.partial_rotary_factor={partial} with YaRN: Megatron-Core 0.16.1's YarnRotaryEmbedding "
            "spans the whole head (kv_channels)"
        )
    truncate = bool(rope.get("truncate", True))
    if mla and not truncate:
        raise NotImplementedError(
            f"{where}.truncate=false with multi-latent attention: Megatron-Core 0.16.1's MLA rounds "
            "the YaRN correction range (no correction_range_round_to_int there)"
        )
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        pair = (float(mscale), float(mscale_all_dim))
    elif mla and mscale_all_dim:
        raise NotImplementedError(
            f"{where}.mscale={mscale!r} with mscale_all_dim={mscale_all_dim!r} and multi-latent attention: "
            "transformers' cos/sin factor and softmax scale need two different mscale_all_dim in "
            "Megatron-Core 0.16.1"
        )
    else:
        pair = (1.0, 0.0)  # get_mscale(factor) / get_mscale(factor, 0) = get_mscale(factor)
    settings = YarnSettings(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        mscale=pair[0],
        mscale_all_dim=pair[1],
        truncate=truncate,
    )
    explicit = rope.get("attention_factor")
    if explicit is not None and not math.isclose(float(explicit), settings.attention_factor, rel_tol=1e-12):
        raise NotImplementedError(
            f"{where}.attention_factor={explicit} differs from the {settings.attention_factor!r} that "
            "Megatron-Core 0.16.1 derives from factor, mscale and mscale_all_dim (it takes no explicit one)"
        )
    return settings


def mla_yarn_kwargs(settings: YarnSettings) -> dict[str, Any]:
    """``MLATransformerConfig`` fields for YaRN (Megatron's MLA builds its own YarnRotaryEmbedding)."""
    return dict(
        rope_type="yarn",
        rotary_scaling_factor=settings.factor,
        original_max_position_embeddings=settings.original_max_position_embeddings,
        beta_fast=settings.beta_fast,
        beta_slow=settings.beta_slow,
        mscale=settings.mscale,
        mscale_all_dim=settings.mscale_all_dim,
    )


def gqa_yarn_fields(settings: YarnSettings) -> dict[str, Any]:
    """The ``yarn_*`` config fields ``GPTModel(position_embedding_type="yarn")`` and Megatron's
    attention read."""
    return dict(
        yarn_rotary_scaling_factor=settings.factor,
        yarn_original_max_position_embeddings=settings.original_max_position_embeddings,
        yarn_beta_fast=settings.beta_fast,
        yarn_beta_slow=settings.beta_slow,
        yarn_mscale=settings.mscale,
        yarn_mscale_all_dim=settings.mscale_all_dim,
        yarn_correction_range_round_to_int=settings.truncate,
    )


@dataclass
class YarnTransformerConfig(TransformerConfig):
    """``TransformerConfig`` with the ``yarn_*`` fields Megatron-Core 0.16.1 reads but does not declare
    (so they survive ``dataclasses.replace`` and copies like every other field)."""

    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True


YARN_FIELDS = tuple(f.name for f in fields(YarnTransformerConfig) if f.name.startswith("yarn_"))


def gqa_transformer_config(
    kwargs: dict[str, Any], settings: YarnSettings, *, model_type: str
) -> TransformerConfig:
    """The ``TransformerConfig`` of ``kwargs`` carrying the YaRN ``settings``; refuses context
    parallelism without CUDA."""
    cp = kwargs.get("context_parallel_size", 1)
    if cp > 1 and not torch.cuda.is_available():
        # Seen: RuntimeError: pin_memory=True requires a CUDA or other accelerator backend (the
        # embedding's constructor caches cos/sin for the original length, sliced per CP rank by
        # rope_utils.get_pos_emb_on_this_cp_rank).
        raise NotImplementedError(
            f"{model_type}: rope_parameters.rope_type='yarn' with parallel.context_parallel_size={cp} "
            "needs CUDA (Megatron-Core 0.16.1's YarnRotaryEmbedding slices its cos/sin cache per CP rank "
            "through pinned memory)"
        )
    return YarnTransformerConfig(**kwargs, **gqa_yarn_fields(settings))
