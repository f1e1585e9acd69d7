"""How a per-token loss becomes a scalar: verl's ``loss_agg_mode``, with global denominators.

Contract: :class:`LossAgg` (and ``agg_loss``, verl's function) turns a per-token matrix
``[batch, response_len]`` into a scalar. Given global denominators (valid tokens / valid sequences
of the whole mini-batch, over all micro-batches and data-parallel ranks), ``agg_loss`` returns this
micro-batch's share of the global value: summing it over micro-batches and ranks gives exactly the
loss of the full mini-batch, however it was split. Without them it uses local counts (a plain mean
over this micro-batch). A caller whose gradient reduction averages over data-parallel ranks
multiplies by the data-parallel size (verl's ``* dp_size``); this module stays collective-free.

Modes (``m`` the mask, ``L`` the loss matrix, ``N_tok``/``N_seq`` the token / sequence counts):

- ``token-mean``: ``Σ_{i,t} m L / N_tok``.
- ``token-sum``: ``Σ_{i,t} m L``, divided by nothing (verl PR 7197; verl's ``* dp_size`` is the
  caller's, as for every mode).
- ``seq-mean-token-sum``: ``Σ_i (Σ_t m L) / N_seq``.
- ``seq-mean-token-mean``: ``Σ_i (Σ_t m L / Σ_t m) / N_seq``.
- ``seq-mean-token-sum-norm`` (Dr. GRPO): ``Σ_i (Σ_t m L / C) / N_seq`` with ``C =
  loss_scale_factor`` (default: ``response_len`` of the tensor; pass a constant such as the
  configured max response length for split invariance).

Sequences with no valid token are not counted in the local ``N_seq``. This follows current verl;
older verl omitted the ``/ N_seq`` in ``seq-mean-token-sum-norm``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from rltrain.algo.masked import masked_mean, masked_sum
from rltrain.algo.registry import Registry

if TYPE_CHECKING:
    from rltrain.algo.rollout_correction import CorrectionStats

AggFn = Callable[[torch.Tensor, torch.Tensor, "LossAgg"], torch.Tensor]

AGG_MODES: Registry[AggFn] = Registry("loss_agg_mode")


@dataclass(frozen=True)
class LossAgg:
    """How a per-token loss becomes a scalar: the mode and the global denominators."""

    mode: str = "token-mean"
    """A name in ``AGG_MODES``: ``token-mean``, ``token-sum``, ``seq-mean-token-sum``,
    ``seq-mean-token-mean`` or ``seq-mean-token-sum-norm``."""

    global_num_tokens: float | torch.Tensor | None = None
    """Valid tokens in the whole mini-batch (all micro-batches, all ranks); ``token-mean`` and the
    metrics divide by it. ``None``: this micro-batch's count."""

    global_num_seqs: float | torch.Tensor | None = None
    """Sequences with at least one valid token in the whole mini-batch; the ``seq-mean-*`` modes
    divide by it. ``None``: this micro-batch's count."""

    loss_scale_factor: float | None = None
    """The constant ``C`` of ``seq-mean-token-sum-norm`` (ignored by the other modes); ``None``:
    ``response_len`` of the tensor."""

    def __post_init__(self) -> None:
        AGG_MODES.get(self.mode)  # fail at construction on a misspelled mode
        if self.loss_scale_factor is not None and self.loss_scale_factor <= 0:
            raise ValueError(f"loss_scale_factor must be > 0, got {self.loss_scale_factor}")

    def __call__(self, loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Aggregate ``loss_mat`` ``[batch, response_len]`` under ``mask`` to a scalar."""
        return AGG_MODES.get(self.mode)(loss_mat, mask, self)

    def token_mean(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean over valid tokens with this aggregation's token denominator (for metrics)."""
        return masked_mean(values, mask, denominator=self.global_num_tokens)

    def seq_mean(self, seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean of ``[batch]`` per-sequence values over the rows of ``mask`` ``[batch, response_len]``
        that have a valid token, with this aggregation's sequence denominator."""
        return _seq_mean(seq_values, mask, self)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_num_tokens: float | torch.Tensor | None = None,
    global_num_seqs: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss to a scalar (verl's ``agg_loss``), see the module docstring.

    Args:
        loss_mat: ``[batch, response_len]`` per-token loss.
        mask: ``[batch, response_len]`` 0/1 valid tokens.
        mode: a name in ``AGG_MODES``.
        global_num_tokens, global_num_seqs, loss_scale_factor: see ``LossAgg``.

    Returns:
        A 0-dim tensor, differentiable w.r.t. ``loss_mat``.
    """
    agg = LossAgg(
        mode=mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    return agg(loss_mat, mask)


@AGG_MODES.register("token-mean")
def _token_mean(loss_mat: torch.Tensor, mask: torch.Tensor, agg: LossAgg) -> torch.Tensor:
    """``[batch, response_len]`` -> 0-dim: sum over valid tokens / token count."""
    return masked_mean(loss_mat, mask, denominator=agg.global_num_tokens)


@AGG_MODES.register("token-sum")
def _token_sum(loss_mat: torch.Tensor, mask: torch.Tensor, agg: LossAgg) -> torch.Tensor:
    """``[batch, response_len]`` -> 0-dim: sum over valid tokens (no denominator)."""
    return masked_sum(loss_mat, mask)


def _seq_mean(seq_losses: torch.Tensor, mask: torch.Tensor, agg: LossAgg) -> torch.Tensor:
    """Mean of ``[batch]`` per-sequence losses over sequences with a valid token."""
    has_tokens = mask.sum(dim=-1) > 0
    if agg.global_num_seqs is None:
        return masked_mean(seq_losses, has_tokens)
    return masked_sum(seq_losses, has_tokens) / agg.global_num_seqs


@AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat: torch.Tensor, mask: torch.Tensor, agg: LossAgg) -> torch.Tensor:
    """``[batch, response_len]`` -> 0-dim: mean over sequences of each sequence's token sum."""
    return _seq_mean(masked_sum(loss_mat, mask, dim=-1), mask, agg)


@AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat: torch.Tensor, mask: torch.Tensor, agg: LossAgg) -> torch.Tensor:
    """``[batch, response_len]`` -> 0-dim: mean over sequences of each sequence's token mean."""
    return _seq_mean(masked_mean(loss_mat, mask, dim=-1), mask, agg)


@AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat: torch.Tensor, mask: torch.Tensor, agg: LossAgg) -> torch.Tensor:
    """``[batch, response_len]`` -> 0-dim: mean over sequences of token sum / ``loss_scale_factor``."""
    scale = agg.loss_scale_factor if agg.loss_scale_factor is not None else loss_mat.shape[-1]
    return _seq_mean(masked_sum(loss_mat, mask, dim=-1) / scale, mask, agg)


@dataclass(frozen=True)
class GlobalCounts:
    """Denominators of one mini-batch, counted over all of its samples (all ranks)."""

    num_tokens: int
    """Valid response tokens."""

    num_seqs: int
    """Samples with at least one valid response token."""

    response_length: int
    """Padded response width (the constant of ``seq-mean-token-sum-norm``)."""

    @classmethod
    def of(cls, response_mask: torch.Tensor) -> GlobalCounts:
        return cls(
            num_tokens=int(response_mask.sum()),
            num_seqs=int((response_mask.sum(-1) > 0).sum()),
            response_length=response_mask.size(-1),
        )

    def kept(self, stats: CorrectionStats) -> GlobalCounts:
        """These counts over the tokens the rejection kept (``stats`` merged over the mini-batch);
        at least 1 each, so an all-rejected mini-batch has a zero loss rather than 0/0."""
        return replace(self, num_tokens=max(stats.kept_tokens, 1), num_seqs=max(stats.kept_seqs, 1))

    def agg(self, mode: str, *, loss_scale_factor: int | None = None) -> LossAgg:
        """Aggregation ``mode`` with these denominators; ``loss_scale_factor`` (the role's
        ``loss_scale_factor``) is the constant of ``seq-mean-token-sum-norm``, ``None``: the padded
        response width."""
        return LossAgg(
            mode,
            global_num_tokens=self.num_tokens,
            global_num_seqs=self.num_seqs,
            loss_scale_factor=self.response_length if loss_scale_factor is None else loss_scale_factor,
        )
