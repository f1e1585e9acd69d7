"""The Megatron model a conversion (or a test, or a bench) lays weights into, with the vocabulary padded.

Contract: ``build_padded_model(hf_config, ctx, dtype=...)`` returns this rank's ``GPTModel`` chunks
(``rltrain.megatron.model.build_model``, role actor) for ``hf_config`` with the vocabulary padded to
Megatron's multiple (``make_vocab_size_divisible_by × TP``, default 128 × TP), so any TP divides it;
``hf_config`` is not modified. The bridge zero-pads embedding and output rows on load and drops them
on export. With ``meta=True`` every parameter sits on the meta device (shapes, dtypes and Megatron's
sharding metadata, no memory): what the streamed checkpoint writer needs.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from megatron_bridge.dims import padded_vocab_size
from rltrain.megatron.model import build_model
from rltrain.megatron.parallel import ParallelContext


def build_padded_model(
    hf_config: Any,
    ctx: ParallelContext,
    *,
    dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = 128,
    meta: bool = False,
) -> list[torch.nn.Module]:
    padded = copy.deepcopy(hf_config)
    padded.vocab_size = padded_vocab_size(
        hf_config.vocab_size, divisible_by=make_vocab_size_divisible_by, tp_size=ctx.tp_size
    )
    if not meta:
        return build_model(padded, ctx=ctx, role="actor", params_dtype=dtype)
    # build_model ends with ``model.to(ctx.device)``: give it the meta device too.
    with torch.device("meta"):
        return build_model(
            padded,
            ctx=dataclasses.replace(ctx, device=torch.device("meta")),
            role="actor",
            params_dtype=dtype,
        )
