"""Per-token log-probabilities and entropy from vocab-parallel logits.

Contract: ``vocab_parallel_logprobs_entropy(logits, targets, tp_group=...)`` takes this rank's slice
of the vocabulary, ``logits: [..., vocab / tp]`` (rank r holds columns [r·V/tp, (r+1)·V/tp)), and the
full-vocabulary ``targets: [...]``, and returns ``(logprobs, entropy)``, each ``[...]``, equal on
every TP rank to ``log_softmax(full_logits).gather(targets)`` and ``-(p · log p).sum(-1)``; columns of
a padded vocabulary (at or beyond ``vocab_size``) take no part. No rank
ever holds a [tokens, full vocabulary] tensor: the max, the sum of exponentials and the target logit
are reduced over TP as [tokens] vectors. Gradients flow to ``logits`` for both outputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int, group: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Columns at or beyond ``vocab_size`` are padding (vocabulary padded to a multiple of TP): skip them.
        num_valid = max(0, min(logits.size(-1), vocab_size - vocab_start))
        valid = logits[..., :num_valid].float()
        if num_valid:
            logits_max = valid.max(dim=-1).values
        else:
            logits_max = valid.new_full(valid.shape[:-1], float("-inf"))
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = valid - logits_max.unsqueeze(-1)
        local_target = targets - vocab_start
        in_slice = (local_target >= 0) & (local_target < num_valid)
        index = local_target.clamp(0, max(num_valid - 1, 0)).unsqueeze(-1)
        target_logit = (
            shifted.gather(-1, index).squeeze(-1) * in_slice
            if num_valid
            else valid.new_zeros(valid.shape[:-1])
        )
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        sum_exp_shifted = exp.mul_(shifted).sum(-1)  # in place: at most two [tokens, vocab/tp] temporaries
        del exp, shifted
        stats = torch.stack([sum_exp, sum_exp_shifted, target_logit])
        if group is not None:
            dist.all_reduce(stats, group=group)
        sum_exp, sum_exp_shifted, target_logit = stats
        log_z = sum_exp.log()
        logprobs = target_logit - log_z
        entropy = log_z - sum_exp_shifted / sum_exp
        ctx.save_for_backward(logits, logits_max, log_z, entropy, index, in_slice)
        ctx.num_valid = num_valid
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor) -> tuple:
        logits, logits_max, log_z, entropy, index, in_slice = ctx.saved_tensors
        num_valid = ctx.num_valid
        log_p = logits[..., :num_valid].float() - (logits_max + log_z).unsqueeze(-1)
        p = log_p.exp()
        # d logprob / d z = onehot - p ;  d entropy / d z = -p (log p + H)
        grad = log_p.add_(entropy.unsqueeze(-1)).mul_(p).mul_(-grad_entropy.unsqueeze(-1))
        grad.sub_(p.mul_(grad_logprobs.unsqueeze(-1)))
        if num_valid:
            grad.scatter_add_(-1, index, (grad_logprobs * in_slice).unsqueeze(-1))
        if num_valid < logits.size(-1):
            grad = torch.cat([grad, grad.new_zeros(*grad.shape[:-1], logits.size(-1) - num_valid)], dim=-1)
        return grad.to(logits.dtype), None, None, None, None


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Any = None,
    tp_rank: int = 0,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [..., vocab/tp] (this rank's slice), targets: [...] → (logprobs [...], entropy [...]).

    ``tp_group=None`` means the logits hold the full vocabulary. ``vocab_size``: the real vocabulary
    when the model's is padded (columns at or beyond it are ignored); None means no padding.
    """
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    local_vocab = logits.size(-1)
    vocab_start = tp_rank * local_vocab
    real = (
        vocab_size
        if vocab_size is not None
        else local_vocab * (dist.get_world_size(tp_group) if tp_group else 1)
    )
    return _VocabParallelLogprobEntropy.apply(logits, targets.long(), vocab_start, real, tp_group)
