"""Megatron ``GPTModel`` chunks from a Hugging Face config of any registered model family.

Contract: ``build_model(hf_config, ctx=..., role=...)`` returns this rank's model chunks (one per
virtual pipeline stage; a single chunk without VPP) with randomly initialized weights; the weight
bridge loads real weights into them through their ``state_dict``. ``role="actor"`` (also used for the
reference) ends in the vocab-parallel LM head; ``role="critic"`` and ``role="reward"`` end in a scalar
head mapping each token's final hidden state to one number (``output_layer.weight``: [1, hidden],
replicated over TP, never tied to the embedding): the critic's values, or the reward model's score,
which the bridge loads from an HF ``*ForSequenceClassification`` checkpoint's ``score.weight``.

The ``TransformerConfig`` and ``GPTModel`` arguments come from :mod:`rltrain.megatron.model_config`
(shapes from the HF config, family differences from its ``ArchitectureFacts``).

On a GPU the layers use Transformer Engine's spec where it imports; without CUDA, or on a GPU without
Transformer Engine (with a warning), they use Megatron's local spec with an attention that also
accepts packed (THD) sequences.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from rltrain.config.moe import MoEConfig
from rltrain.megatron.converters import ModelConverter, apply_converters
from rltrain.megatron.cpu_compat import transformer_engine_problem
from rltrain.megatron.local_spec import local_block_spec, local_mtp_block_spec
from rltrain.megatron.model_config import (
    SCALAR_HEAD_ROLES,
    Role,
    architecture_facts,
    gpt_options,
    padded_vocab_size,
    transformer_config_from_hf,
)
from rltrain.megatron.parallel import ParallelContext

log = logging.getLogger(__name__)


def layer_spec(config: TransformerConfig, *, vp_stage: int | None) -> ModuleSpec | TransformerBlockSubmodules:
    """Transformer Engine layers on GPU; Megatron's local layers (packed-capable attention, an RMSNorm
    that supports sequence parallelism) on CPU, and on a GPU where Transformer Engine does not import
    (Megatron's TE spec would fail there with ``NameError: name 'TESpecProvider' is not defined``;
    the local layers run on CUDA, without TE's fused kernels)."""
    if not torch.cuda.is_available():
        return local_block_spec(config, vp_stage=vp_stage)
    problem = transformer_engine_problem()
    if problem is not None:
        _warn_local_layers_on_cuda(problem)
        return local_block_spec(config, vp_stage=vp_stage)
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if config.multi_latent_attention or isinstance(config.moe_layer_freq, list):
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
    return get_gpt_layer_with_transformer_engine_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
    )


@functools.cache
def _warn_local_layers_on_cuda(problem: str) -> None:
    log.warning(
        "Transformer Engine does not import (%s): the layers on CUDA are Megatron's local ones, "
        "without its fused kernels (install transformer-engine for them)",
        problem,
    )


def mtp_block_spec(config: TransformerConfig, spec: Any, *, vp_stage: int | None) -> Any:
    """Megatron-Core's multi-token-prediction block of this stage (None where it has none), built
    from the stage's decoder spec ``spec``, with the same backend."""
    if not config.mtp_num_layers:
        return None
    if isinstance(spec, TransformerBlockSubmodules) and not _uses_transformer_engine():
        return local_mtp_block_spec(config, spec, vp_stage=vp_stage)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=True, vp_stage=vp_stage)


def _uses_transformer_engine() -> bool:
    return torch.cuda.is_available() and transformer_engine_problem() is None


class MTPHeldGPTModel(GPTModel):
    """A ``GPTModel`` holding multi-token-prediction layers that training ignores (the default
    ``ignore`` mode): they are built, loaded, checkpointed and exported like every weight, frozen
    (``requires_grad=False``: no gradient, outside the optimizer), and the forward returns the main
    head's output only. Megatron's own forward would run them and need ``labels`` for their loss.
    With ``train_mtp`` (``model.mtp.enable_train``) they are trainable and a training pass also
    returns their outputs (:func:`rltrain.megatron.mtp.postprocess_with_mtp`); with
    ``detach_mtp_inputs`` (``model.mtp.detach_encoder``) their loss's gradient stops at their inputs."""

    train_mtp: bool = False
    detach_mtp_inputs: bool = False

    def _postprocess(self, *args: Any, **kwargs: Any) -> Any:
        if self.train_mtp and self.training and self.mtp_process:
            from rltrain.megatron.mtp import postprocess_with_mtp

            return postprocess_with_mtp(self, self._main_postprocess, **kwargs)
        return self._main_postprocess(*args, **kwargs)

    def _main_postprocess(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["mtp_in_postprocess"] = False
        # GPTModel._postprocess computes the MTP loss whenever config.mtp_num_layers is set
        num_layers, self.config.mtp_num_layers = self.config.mtp_num_layers, None
        try:
            return super()._postprocess(*args, **kwargs)
        finally:
            self.config.mtp_num_layers = num_layers

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
        # Megatron-Core 0.16.1's GPTModel reads metadata["dp_cp_group"] for an MTP stage's embedding
        # copy without filling in the default it fills in everywhere else (None: TypeError)
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)


class ValueHead(torch.nn.Module):
    """Scalar head of the critic and the reward model: final hidden state → one number per token,
    ``F.linear`` without bias (HF's ``score``); stands in for ``GPTModel.output_layer``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.sequence_parallel = config.sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype))
        config.init_method(self.weight)

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        """hidden: [seq(/tp with SP), batch, hidden] → values [seq, batch, 1]."""
        if self.sequence_parallel:
            # Every TP rank computes the same values (and loss), so the backward only splits.
            hidden = tensor_parallel.gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False
            )
        return F.linear(hidden, self.weight), None


def unmark_expert_biases_sequence_parallel(model: torch.nn.Module) -> None:
    """Take the ``sequence_parallel`` mark off routed experts' parameters (GPT-OSS's expert biases).

    Megatron-Core 0.16.1's ``RowParallelLinear`` marks its bias ``sequence_parallel`` whenever the
    config has sequence parallelism, experts' too, and ``finalize_model_grads`` then sums every marked
    gradient over the tensor-parallel group. An expert's bias is no sequence-parallel replica: the
    dispatcher brings it every token routed to it, so its gradient is whole on its own rank, and at
    TP=2 over EP=2 the ranks of a TP group hold different experts; the sum added another expert's
    gradient to each (gpt-oss at TP=2 with sequence parallelism over EP=2: grad norm 14.4105 against
    the single rank's 14.4083)."""
    for param in model.parameters():
        if getattr(param, "allreduce", True) is False and getattr(param, "sequence_parallel", False):
            param.sequence_parallel = False


def build_model(
    hf_config: Any,
    *,
    ctx: ParallelContext,
    role: Role = "actor",
    params_dtype: torch.dtype | None = None,
    recompute_activations: bool = False,
    make_vocab_size_divisible_by: int = 1,
    moe_options: MoEConfig | None = None,
    converters: Sequence[ModelConverter] = (),
    train_mtp: bool = False,
    detach_mtp_inputs: bool = False,
) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage) for ``hf_config``.

    The vocabulary is padded to a multiple of ``make_vocab_size_divisible_by × TP``; the logprob path
    ignores the padded columns when given the real ``vocab_size``. ``converters`` transform each chunk
    as it is built (:mod:`rltrain.megatron.converters`). ``train_mtp``: the multi-token-prediction
    layers train (``model.mtp.enable_train``) instead of staying frozen; ``detach_mtp_inputs``: their
    loss's gradient stops at their inputs (``model.mtp.detach_encoder``).
    """
    if role not in ("actor", "reference", "critic", "reward"):
        raise ValueError(f"role={role!r}; expected actor, reference, critic or reward")
    dtype = params_dtype or (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    config = transformer_config_from_hf(
        hf_config,
        parallel=ctx.parallel,
        params_dtype=dtype,
        recompute_activations=recompute_activations,
        moe_options=moe_options,
    )
    vocab = padded_vocab_size(
        hf_config.vocab_size, tp_size=ctx.tp_size, divisible_by=make_vocab_size_divisible_by
    )
    options = gpt_options(hf_config, role=role, vocab_size=vocab)
    mla = architecture_facts(hf_config).mla
    if role in SCALAR_HEAD_ROLES:
        config.mtp_num_layers = None  # a value or score head has no next-next-token predictions
    if train_mtp and (role != "actor" or not config.mtp_num_layers):
        raise ValueError(
            f"model.mtp.enable_train: the {role} of this {hf_config.model_type} model has no "
            "multi-token-prediction layers to train (num_nextn_predict_layers: 0)"
        )
    num_chunks = ctx.vpp_size or 1
    chunks = []
    for vp_stage in range(num_chunks):
        pre = mpu.is_pipeline_first_stage(ignore_virtual=num_chunks == 1, vp_stage=vp_stage)
        post = mpu.is_pipeline_last_stage(ignore_virtual=num_chunks == 1, vp_stage=vp_stage)
        spec = layer_spec(config, vp_stage=vp_stage if num_chunks > 1 else None)
        mtp_spec = mtp_block_spec(config, spec, vp_stage=vp_stage if num_chunks > 1 else None)
        model = (MTPHeldGPTModel if config.mtp_num_layers else GPTModel)(
            config=config,
            transformer_layer_spec=spec,
            mtp_block_spec=mtp_spec,
            vocab_size=options.vocab_size,
            max_sequence_length=options.max_sequence_length,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=options.tie_word_embeddings,
            position_embedding_type=options.position_embedding_type,
            rotary_base=options.rotary_base,
            rope_scaling=options.rope_scaling,
            rope_scaling_factor=options.rope_scaling_factor,
            seq_len_interpolation_factor=options.seq_len_interpolation_factor,
            rotary_percent=options.rotary_percent,
            vp_stage=vp_stage if num_chunks > 1 else None,
        )
        if role in SCALAR_HEAD_ROLES and post:
            model.output_layer = ValueHead(config)
        if mla and mla.latent_norm_eps != config.layernorm_epsilon:
            set_latent_norm_eps(model, mla.latent_norm_eps)
        if mtp_spec is not None and not train_mtp:
            model.mtp.requires_grad_(False)
        if config.mtp_num_layers:
            model.train_mtp, model.detach_mtp_inputs = train_mtp, detach_mtp_inputs
        unmark_expert_biases_sequence_parallel(model)
        model.to(ctx.device)
        apply_converters(model, converters)
        chunks.append(model)
    return chunks


def set_latent_norm_eps(model: torch.nn.Module, eps: float) -> int:
    """Give multi-latent attention's latent norms (``q_layernorm``, ``kv_layernorm``) ``eps``;
    returns how many were set.

    Megatron builds them with ``layernorm_epsilon`` (the decoder's ``rms_norm_eps``); transformers
    with its RMSNorm's default 1e-6 (``MLAFacts.latent_norm_eps``), which differs where a checkpoint's
    ``rms_norm_eps`` is not 1e-6 (Moonlight: 1e-5). Where Transformer Engine fuses a norm into the
    up projection (the norm is an ``IdentityOp``) the fused module's ``eps`` is set; a norm that keeps
    its eps elsewhere is refused by name rather than left at the wrong value.
    """
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    count = 0
    for attention in model.modules():
        if not isinstance(attention, MLASelfAttention):
            continue
        for norm_name, fused_into in (
            ("q_layernorm", "linear_q_up_proj"),
            ("kv_layernorm", "linear_kv_up_proj"),
        ):
            norm = getattr(attention, norm_name, None)
            if norm is None:  # no query latent (q_lora_rank: null)
                continue
            if isinstance(norm, IdentityOp):
                norm = getattr(attention, fused_into)
            if not isinstance(getattr(norm, "eps", None), float):
                raise NotImplementedError(
                    f"multi-latent attention's {norm_name} ({type(norm).__name__}) has no eps attribute to "
                    f"set to {eps} (transformers' latent norm eps; rms_norm_eps differs)"
                )
            norm.eps = eps
            count += 1
    return count


def gpt_model(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside Megatron's wrappers (DDP, Float16Module)."""
    while hasattr(chunk, "module") and not hasattr(chunk, "output_layer"):
        chunk = chunk.module
    return chunk
