"""Per-token log-probabilities and entropy from vocab-parallel logits.

Contract: ``vocab_parallel_logprobs_entropy(logits, targets, tp_group=...)`` takes this rank's slice
of the vocabulary, ``logits: [..., vocab / tp]`` (rank r holds columns [r·V/tp, (r+1)·V/tp)), and the
full-vocabulary ``targets: [...]``, and returns ``(logprobs, entropy)``, each ``[...]``, equal on
every TP rank to ``log_softmax(full_logits).gather(targets)`` and ``-(p · log p).sum(-1)``. No rank
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
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.float()
        local_vocab = logits.size(-1)
        logits_max = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        local_target = targets - vocab_start
        in_slice = (local_target >= 0) & (local_target < local_vocab)
        index = local_target.clamp(0, local_vocab - 1).unsqueeze(-1)
        target_logit = shifted.gather(-1, index).squeeze(-1) * in_slice
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        sum_exp_shifted = exp.mul_(shifted).sum(-1)  # in place: at most two [tokens, vocab/tp] temporaries
        del exp, shifted
        sums = torch.stack([sum_exp, sum_exp_shifted])
        stats = torch.cat([sums, target_logit.unsqueeze(0)])
        if group is not None:
            dist.all_reduce(stats, group=group)
        sum_exp, sum_exp_shifted, target_logit = stats
        log_z = sum_exp.log()
        logprobs = target_logit - log_z
        entropy = log_z - sum_exp_shifted / sum_exp
        ctx.save_for_backward(logits, logits_max, log_z, entropy, index, in_slice)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor) -> tuple:
        logits, logits_max, log_z, entropy, index, in_slice = ctx.saved_tensors
        log_p = logits - (logits_max + log_z).unsqueeze(-1)
        p = log_p.exp()
        # d logprob / d z = onehot - p ;  d entropy / d z = -p (log p + H)
        grad = log_p.add_(entropy.unsqueeze(-1)).mul_(p).mul_(-grad_entropy.unsqueeze(-1))
        grad.sub_(p.mul_(grad_logprobs.unsqueeze(-1)))
        grad.scatter_add_(-1, index, (grad_logprobs * in_slice).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, tp_group: Any = None, tp_rank: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [..., vocab/tp] (this rank's slice), targets: [...] → (logprobs [...], entropy [...]).

    ``tp_group=None`` means the logits hold the full vocabulary.
    """
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    vocab_start = tp_rank * logits.size(-1)
    return _VocabParallelLogprobEntropy.apply(logits, targets.long(), vocab_start, tp_group)
