"""The multi-token-prediction (MTP) loss of the actor: pure tensor math.

MTP layer ``k`` (0-based; DeepSeek-V3's ``num_nextn_predict_layers``) predicts token ``t + k + 2``
from the main model's hidden state at position ``t`` and the embedding of token ``t + k + 1``. Its
loss is the cross-entropy of the response tokens it predicts, as verl's Megatron actor computes it
(labels = the response tokens, Megatron-Core rolling them by one per layer): response token ``j``
at column ``c`` counts when its predictor column ``c - 2 - k`` holds a real token. Departures from
Megatron-Core's ``MTPLossAutoScaler`` path, which divides each micro-batch's sum by that
micro-batch's own token count: the per-token losses are aggregated like the policy loss
(``loss_agg_mode`` with the mini-batch's global denominators), so that the sum over micro-batches
and data-parallel ranks is the mini-batch's loss for any split; and rejected tokens of rollout
correction are dropped as from every actor term. The layers' losses are averaged (Megatron's
``mtp_loss_scaling_factor / mtp_num_layers`` per layer).
"""

from __future__ import annotations

import torch

from rltrain.algo.loss_agg import LossAgg


def mtp_response_mask(
    attention_mask: torch.Tensor, response_mask: torch.Tensor, *, depth: int
) -> torch.Tensor:
    """[batch, response_len]: ``response_mask`` where MTP layer ``depth`` has a predictor.

    ``attention_mask``: [batch, seq], the last ``response_len`` columns the response; real tokens of
    a row are contiguous (left-padded prompt, right-padded response)."""
    seq, response_len = attention_mask.size(1), response_mask.size(1)
    cols = torch.arange(seq - response_len, seq, device=attention_mask.device) - 2 - depth
    real = attention_mask[:, cols.clamp(min=0)].bool() & (cols >= 0)
    return response_mask * real.to(response_mask.dtype)


def mtp_loss(
    mtp_logprobs: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor, agg: LossAgg
) -> torch.Tensor:
    """Mean over MTP layers of ``agg(-log p, mask of the layer)``.

    ``mtp_logprobs``: [num_mtp_layers, batch, response_len], layer k's log-prob of each response
    token (any value where it has no predictor); ``response_mask``: [batch, response_len] the tokens
    the actor trains on."""
    losses = [
        agg(-logprobs, mtp_response_mask(attention_mask, response_mask, depth=k))
        for k, logprobs in enumerate(mtp_logprobs)
    ]
    return torch.stack(losses).mean()
