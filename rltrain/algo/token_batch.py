"""The batch contract of the trainer: what a model role is fed, what it returns, what a loss sees.

Pure torch (no Megatron, Ray or vLLM), so that the driver side builds batches and the losses are
written and tested without a model. Three pieces:

- :class:`TokenBatch`: padded rows ``[prompt (left-padded) | response (right-padded)]``, the last
  ``response_len`` columns being the response, plus the per-token tensors a loss reads, as named
  optional fields (``old_logprobs``, ``advantages``, ...), each ``[batch, response_len]``, sliced
  together with the rows into micro-batches.
- :class:`ModelOutput`: per-response-token outputs of a forward pass (actor/reference logprobs and
  entropy, or critic values), ``[batch, response_len]``, zero where the response is padding.
- :class:`LossFn`: ``loss_fn(output, micro_batch) -> (loss, metrics)`` on one micro-batch. It must
  use global denominators (e.g. the valid-token count of the whole mini-batch on all data-parallel
  ranks), so that its sum over micro-batches and ranks is the mini-batch loss and gradients do not
  depend on the split; the metrics add up the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

LOSS_INPUTS = ("old_logprobs", "ref_logprobs", "rollout_logprobs", "advantages", "values", "returns")
"""The optional per-token fields of :class:`TokenBatch` (named as in the driver's ``StepBatch``)."""


@dataclass
class TokenBatch:
    """Padded token rows; the last ``response_len`` columns are the response.

    The per-token loss inputs are None unless the loss of the call reads them.
    """

    input_ids: torch.Tensor
    """[batch, seq] long."""
    attention_mask: torch.Tensor
    """[batch, seq] 1 for real tokens, 0 for padding (left in the prompt, right in the response)."""
    response_len: int
    """Number of response columns at the end of each row."""
    old_logprobs: torch.Tensor | None = None
    """[batch, response_len] actor log-probs before the update (π_old): the PPO ratio's denominator."""
    ref_logprobs: torch.Tensor | None = None
    """[batch, response_len] reference-policy log-probs (the KL loss)."""
    rollout_logprobs: torch.Tensor | None = None
    """[batch, response_len] log-probs the rollout engine reported (truncated importance sampling)."""
    advantages: torch.Tensor | None = None
    """[batch, response_len] advantage of each response token."""
    values: torch.Tensor | None = None
    """[batch, response_len] critic values before the update (the clipped value loss's centre)."""
    returns: torch.Tensor | None = None
    """[batch, response_len] value targets."""
    sampled_mask: torch.Tensor | None = None
    """[batch, response_len] 1 on the tokens the policy sampled, where a multi-turn response also holds
    tool or environment tokens (attended to, never trained on); None: every real response token."""
    routed_experts: torch.Tensor | None = None
    """[batch, seq, num_layers, top_k] long: the experts each token was routed to in each layer (MoE
    routing replay, ``router_replay.mode``), aligned with ``input_ids``; dense layers' slots and padding
    are ignored. None: the routers choose."""

    @property
    def batch_size(self) -> int:
        return self.input_ids.size(0)

    @property
    def response_mask(self) -> torch.Tensor:
        """[batch, response_len] 1 on the response tokens the losses train on (``sampled_mask`` if set)."""
        if self.sampled_mask is not None:
            return self.sampled_mask
        return self.attention_mask[:, -self.response_len :]

    def select(self, index: list[int]) -> TokenBatch:
        """The rows at ``index`` (in that order), every set loss input sliced alike."""
        idx = torch.tensor(index, dtype=torch.long, device=self.input_ids.device)
        inputs = {}
        for name in (*LOSS_INPUTS, "sampled_mask", "routed_experts"):
            value = getattr(self, name)
            if value is not None:
                inputs[name] = value[idx.to(value.device)]
        return replace(self, input_ids=self.input_ids[idx], attention_mask=self.attention_mask[idx], **inputs)

    def to(self, device: torch.device) -> TokenBatch:
        """The same rows with every tensor on ``device`` (itself where all already are), so that a loss
        reads its inputs where the model's outputs are."""
        moved = {}
        for name in ("input_ids", "attention_mask", *LOSS_INPUTS, "sampled_mask", "routed_experts"):
            value = getattr(self, name)
            if value is not None and value.device != torch.device(device):
                moved[name] = value.to(device)
        return replace(self, **moved) if moved else self


@dataclass
class ModelOutput:
    """Per-response-token outputs, [batch, response_len], zero where the response is padding."""

    logprobs: torch.Tensor | None = None
    """log p(response token | prefix) (actor / reference)."""
    entropy: torch.Tensor | None = None
    """Entropy of the next-token distribution at the same positions (actor / reference)."""
    values: torch.Tensor | None = None
    """Critic value at the same positions."""
    routed_experts: torch.Tensor | None = None
    """[batch, seq, num_layers, top_k] long: the experts the routers chose for every token (a recording
    pass of routing replay), 0 on padding and in dense layers' slots; None otherwise."""
    mtp_logprobs: torch.Tensor | None = None
    """[num_mtp_layers, batch, response_len]: multi-token-prediction layer k's log-prob of each
    response token, predicted from the position k + 1 before the main head's (the MTP loss,
    ``model.mtp.enable_train``), zero where that position is padding; None otherwise."""


class LossFn(Protocol):
    """(micro-batch outputs, micro-batch) → (loss with global denominators, metrics to sum)."""

    def __call__(
        self, output: ModelOutput, micro_batch: TokenBatch, /
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...
