"""Rollout-vs-trainer logprob mismatch on the sampled response tokens, measured every step.

The rollout engine samples with its own kernels (and, on GPU, its own dtype); the trainer recomputes
the same tokens' logprobs with Megatron. Their gap is the off-policy error that PPO's ratio would
otherwise silently absorb. With ``d = trainer_logprobs - rollout_logprobs`` over valid tokens:

- ``logprob_abs_diff_mean`` = Σ|d| / N,  ``logprob_abs_diff_max`` = max |d|
- ``importance_ratio_mean`` = Σ exp(d) / N (the weight truncated importance sampling would apply)
- with ``tis_cap``: ``importance_ratio_capped_frac``, the share of tokens whose ratio exceeds the cap.

``N`` is the local count of valid tokens unless the caller passes ``num_valid_tokens`` (the global
count), so that per-micro-batch sums add up to the global mean; maxima are local (reduce with max).
Pure tensor math; no engine, no trainer.
"""

from __future__ import annotations

import torch


def logprob_mismatch(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tis_cap: float | None = None,
    num_valid_tokens: float | None = None,
    prefix: str = "rollout/",
) -> dict[str, float]:
    """Mismatch metrics of ``[batch, response_len]`` logprobs over ``response_mask`` (0/1, same shape).

    Returns ``{prefix + name: value}``; an all-masked batch gives zero diffs and a ratio mean of 0.
    """
    if trainer_logprobs.shape != rollout_logprobs.shape or trainer_logprobs.shape != response_mask.shape:
        raise ValueError(
            f"shape mismatch: trainer_logprobs {tuple(trainer_logprobs.shape)}, rollout_logprobs "
            f"{tuple(rollout_logprobs.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    mask = response_mask.bool()
    diff = (trainer_logprobs.double() - rollout_logprobs.double())[mask]
    count = float(num_valid_tokens) if num_valid_tokens is not None else float(diff.numel())
    denom = max(count, 1.0)
    abs_diff = diff.abs()
    ratio = torch.exp(diff)
    metrics = {
        "logprob_abs_diff_mean": float(abs_diff.sum()) / denom,
        "logprob_abs_diff_max": float(abs_diff.max()) if diff.numel() else 0.0,
        "importance_ratio_mean": float(ratio.sum()) / denom,
    }
    if tis_cap is not None:
        metrics["importance_ratio_capped_frac"] = float((ratio > tis_cap).sum()) / denom
    return {prefix + key: value for key, value in metrics.items()}
