"""Micro-batch splits: fixed size, or dynamic (verl's ``use_dynamic_bsz``) under a token budget.

Contract: both functions return lists of sample indices that cover ``range(num_samples)`` exactly once;
each micro-batch lists its indices in ascending order. ``split_by_token_budget`` fills micro-batches up
to ``max_tokens`` real tokens (verl's ``ppo_max_token_len_per_gpu``) with first-fit decreasing, so the
number of micro-batches is small and none exceeds the budget. Pure Python; no torch needed.
"""

from __future__ import annotations

from collections.abc import Sequence


def split_fixed(num_samples: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive micro-batches of ``micro_batch_size`` samples (the last one may be smaller)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [
        list(range(start, min(start + micro_batch_size, num_samples)))
        for start in range(0, num_samples, micro_batch_size)
    ]


def split_by_token_budget(seq_lens: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Micro-batches of sample indices whose ``seq_lens`` sum to at most ``max_tokens`` each."""
    longest = max(seq_lens, default=0)
    if longest > max_tokens:
        raise ValueError(
            f"ppo_max_token_len_per_gpu={max_tokens} is smaller than the longest sequence ({longest} tokens)"
        )
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i)):
        length = seq_lens[index]
        for b, load in enumerate(loads):
            if load + length <= max_tokens:
                bins[b].append(index)
                loads[b] += length
                break
        else:
            bins.append([index])
            loads.append(length)
    return [sorted(b) for b in bins]
