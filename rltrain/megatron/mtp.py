"""The actor's forward with its multi-token-prediction (MTP) layers trained (``model.mtp.enable_train``).

Contract: in a training pass, :func:`postprocess_with_mtp` runs Megatron-Core's MTP block on the
decoder's output (on the last pipeline stage, where Megatron-Core 0.16.1 builds it without a custom
layout), then the output layer on the main hidden states and on each MTP layer's, and returns them
one after the other along the rows: [(1 + num_mtp_layers) × rows, tokens, vocab / tp] (or the
final hidden states in place of logits while the fused head stands in for the output layer), the
main head's part first, laid out as without MTP. The
loss reads them (:func:`~rltrain.megatron.head_outputs.head_outputs`, :mod:`rltrain.algo.mtp_loss`).
Megatron-Core's own MTP loss (``MTPLossAutoScaler``, labels rolled inside the model, the
micro-batch's own token count as denominator) is not used: the loss is rltrain's, with the
mini-batch's global denominators, and works with the fused head (Megatron's would run the stand-in).
With ``detach_mtp_inputs`` (verl's ``detach_encoder``) the MTP block reads the decoder's output and
the token embeddings cut from the graph, so its loss trains the MTP layers and the shared output
layer only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rltrain.megatron.model import gpt_model


def postprocess_with_mtp(model: Any, postprocess: Callable[..., torch.Tensor], **kwargs: Any) -> torch.Tensor:
    """``GPTModel._postprocess``'s keyword arguments → the main head's output, then each MTP layer's,
    concatenated along the rows; ``postprocess`` is the main head's (MTP off)."""
    hidden_states, embedding = kwargs["hidden_states"], model.embedding
    if model.detach_mtp_inputs:
        hidden_states, embedding = hidden_states.detach(), _Detached(model.embedding)
    hidden = model.mtp(
        input_ids=kwargs["input_ids"],
        position_ids=kwargs["position_ids"],
        hidden_states=hidden_states,
        attention_mask=kwargs.get("attention_mask"),
        inference_params=kwargs.get("inference_params"),
        rotary_pos_emb=kwargs.get("rotary_pos_emb"),
        rotary_pos_cos=kwargs.get("rotary_pos_cos"),
        rotary_pos_sin=kwargs.get("rotary_pos_sin"),
        packed_seq_params=kwargs.get("packed_seq_params"),
        sequence_len_offset=kwargs.get("sequence_len_offset"),
        embedding=embedding,
        **(kwargs.get("extra_block_kwargs") or {}),
    )
    # the block's first part is its input (detached with detach_mtp_inputs): the main head reads the
    # decoder's output itself
    layers = hidden.chunk(1 + len(model.mtp.layers), dim=0)[1:]
    logits = postprocess(**kwargs)
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    extra = [model.output_layer(layer, weight=weight)[0].transpose(0, 1) for layer in layers]
    return torch.cat([logits, *extra], dim=0)


class _Detached:
    """The embedding with its output cut from the graph (the MTP loss does not train it)."""

    def __init__(self, embedding: torch.nn.Module) -> None:
        self.embedding = embedding

    def __call__(self, **kwargs: Any) -> torch.Tensor:
        return self.embedding(**kwargs).detach()


def trained_mtp_layers(chunk: torch.nn.Module) -> int:
    """How many MTP layers' outputs follow the main head's in ``chunk``'s output now (0 unless it
    trains its MTP layers and is in a training pass)."""
    model = gpt_model(chunk)
    if not (getattr(model, "train_mtp", False) and model.training and hasattr(model, "mtp")):
        return 0
    return len(model.mtp.layers)
