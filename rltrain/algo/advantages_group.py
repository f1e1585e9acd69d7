"""Group advantage estimators: each response's outcome score against the other responses to its prompt.

Contract: the estimators of :mod:`rltrain.algo.advantages` (same ``AdvantageInputs`` and
``AdvantageOutput``, same registry, zero on masked positions) that need ``group_ids``: responses to
one prompt share an id. The outcome score ``s_i`` of a response is the sum of its token rewards over
its valid tokens; every estimator here turns the scores into one value per response, put on each of
its valid tokens, and returns it as both advantages and returns (verl). Shapes, for every estimator
here: rewards and mask ``[batch, response_len]``, group ids ``[batch]`` -> advantages = returns
``[batch, response_len]``. "Group of one" below is a prompt with a single response in the batch;
the config asks for ``rollout.n >= 2``, so it arises only where a caller drops samples.

- ``grpo`` (Shao et al. 2024): ``(s - group mean) / (group std + epsilon)`` with the unbiased std,
  or ``s - group mean`` when ``norm_adv_by_std_in_grpo=False`` (Dr. GRPO, Liu et al. 2025). As in
  verl a group of one has mean 0 and std 1, so its advantage is its score (divided by
  ``1 + epsilon``).
- ``rloo`` (Ahmadian et al. 2024): score minus the mean score of the other samples of its group,
  computed as ``(s - group mean) * n / (n - 1)``; a group of one keeps its raw score (verl).
- ``reinforce_plus_plus_baseline``: score minus group mean (0 for a group of one), broadcast over
  the valid tokens, whitened over the batch.
- ``opo`` (Hao et al. 2025, arXiv:2505.23585, on-policy RL with the optimal reward baseline):
  ``s_i - b_g`` with the length-weighted group mean ``b_g = Σ_j |o_j| s_j / Σ_j |o_j|``, ``|o_j|``
  the number of valid tokens of response ``j``; an empty row weighs nothing. A group of one has
  ``b = 0`` (verl). Departure from verl: a group without any valid token gets ``b = 0`` where verl
  divides 0 by 0 (NaN that survives its masking).
- ``gpg`` (Chu et al. 2025, arXiv:2504.02546): ``α (s - group mean) / F_norm`` with
  ``α = B / max(1, #{i : s_i ≠ 0})`` over the whole batch of ``B`` responses and ``F_norm = 1``
  (verl's default; its trainer never sets another, so there is no config key). A group of one has
  mean 0. The paper motivates α as compensating for the samples that carry no gradient; verl,
  followed here, counts the nonzero scores (with 0/1 rewards: the correct responses) instead.
- ``grpo_passk`` (Pass@k training; arXiv:2503.19595, the reference verl cites): only the best response of
  each group gets a nonzero value, ``s_max - s_second`` (the two largest scores of the group),
  divided by ``group std + epsilon`` (unbiased std of all the group's scores) when
  ``norm_adv_by_std_in_grpo`` is true; every other response gets 0. Every group needs at least two
  responses (verl raises too). Among equal best scores the lowest row wins, where verl's ``topk``
  leaves the choice open; the value is then ``0`` either way. An empty row competes with its score
  0 like any other (verl), and when it wins the advantage lands on no token.
"""

from __future__ import annotations

import torch

from rltrain.algo.advantages import (
    AdvantageInputs,
    AdvantageOutput,
    AdvantageParams,
    outcome_scores,
    per_token,
    register_adv_estimator,
    require_input,
)
from rltrain.algo.masked import masked_whiten

GROUP = ("group_ids",)
"""What every estimator here reads beside the rewards and the mask."""


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct ids ``[num_groups]`` (sorted) and each sample's position among them ``[batch]``."""
    unique_ids, group_index = torch.unique(group_ids, return_inverse=True)
    return unique_ids, group_index


def _group_sum(values: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``[num_groups]``: sum of ``values`` ``[batch]`` over each group."""
    return values.new_zeros(num_groups).index_add_(0, group_index, values)


def _group_mean_std_size(
    scores: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample statistics of its group, each ``[batch]``.

    Mean and unbiased std of the scores in the sample's group and the group size; a group of one
    gets mean 0 and std 1 (verl's convention).
    """
    unique_ids, group_index = _group_index(group_ids)
    num_groups = unique_ids.numel()
    sizes = torch.bincount(group_index, minlength=num_groups).to(scores.dtype)
    means = _group_sum(scores, group_index, num_groups) / sizes
    squared = (scores - means[group_index]) ** 2
    variances = _group_sum(squared, group_index, num_groups) / (sizes - 1).clamp(min=1)
    single = sizes == 1
    means = torch.where(single, torch.zeros_like(means), means)
    stds = torch.where(single, torch.ones_like(variances), variances.sqrt())
    return means[group_index], stds[group_index], sizes[group_index]


def _groups_and_scores(inputs: AdvantageInputs, estimator: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Group ids ``[batch]`` (required) and outcome scores ``[batch]``."""
    return require_input(inputs.group_ids, "group_ids", estimator), outcome_scores(inputs)


def _outcome(per_sequence: torch.Tensor, inputs: AdvantageInputs) -> AdvantageOutput:
    """``[batch]`` on the valid tokens of ``[batch, response_len]``, as both advantages and returns."""
    advantages = per_token(per_sequence, inputs.response_mask)
    return AdvantageOutput(advantages=advantages, returns=advantages)


@register_adv_estimator("grpo", needs=GROUP)
def grpo(inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Group-normalized outcome advantage (GRPO, or Dr. GRPO without the std)."""
    group_ids, scores = _groups_and_scores(inputs, "grpo")
    means, stds, _ = _group_mean_std_size(scores, group_ids)
    centered = scores - means
    if params.norm_adv_by_std_in_grpo:
        centered = centered / (stds + params.epsilon)
    return _outcome(centered, inputs)


@register_adv_estimator("rloo", needs=GROUP)
def rloo(inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """REINFORCE leave-one-out: score minus the mean of the other scores of the group."""
    group_ids, scores = _groups_and_scores(inputs, "rloo")
    means, _, sizes = _group_mean_std_size(scores, group_ids)
    # For a group of one, means is 0 and the factor 1: the raw score is kept (verl).
    factor = torch.where(sizes > 1, sizes / (sizes - 1).clamp(min=1), torch.ones_like(sizes))
    return _outcome((scores - means) * factor, inputs)


@register_adv_estimator("reinforce_plus_plus_baseline", needs=GROUP)
def reinforce_plus_plus_baseline(inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Score minus group mean, broadcast over valid tokens, whitened over the batch."""
    group_ids, scores = _groups_and_scores(inputs, "reinforce_plus_plus_baseline")
    means, _, _ = _group_mean_std_size(scores, group_ids)
    mask = inputs.response_mask.to(scores.dtype)
    centered = per_token(scores - means, mask)
    advantages = masked_whiten(centered, mask) * mask
    return AdvantageOutput(advantages=advantages, returns=advantages)


@register_adv_estimator("opo", needs=GROUP)
def opo(inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Score minus the length-weighted mean score of its group (OPO's optimal baseline)."""
    group_ids, scores = _groups_and_scores(inputs, "opo")
    lengths = inputs.response_mask.to(scores.dtype).sum(dim=-1)
    unique_ids, group_index = _group_index(group_ids)
    num_groups = unique_ids.numel()
    weighted = _group_sum(lengths * scores, group_index, num_groups)
    total_length = _group_sum(lengths, group_index, num_groups)
    sizes = torch.bincount(group_index, minlength=num_groups)
    has_baseline = (sizes > 1) & (total_length > 0)
    baselines = torch.where(has_baseline, weighted / total_length.clamp(min=1), torch.zeros_like(weighted))
    return _outcome(scores - baselines[group_index], inputs)


@register_adv_estimator("gpg", needs=GROUP)
def gpg(inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """GPG: group-centred score scaled by batch size over the number of nonzero scores."""
    group_ids, scores = _groups_and_scores(inputs, "gpg")
    means, _, _ = _group_mean_std_size(scores, group_ids)
    num_nonzero = torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    alpha = scores.numel() / num_nonzero
    return _outcome(alpha * (scores - means), inputs)


@register_adv_estimator("grpo_passk", needs=GROUP)
def grpo_passk(inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Pass@k: the best response of each group gets best minus second-best score, the others 0."""
    group_ids, scores = _groups_and_scores(inputs, "grpo_passk")
    unique_ids, group_index = _group_index(group_ids)
    sizes = torch.bincount(group_index, minlength=unique_ids.numel())
    if bool((sizes < 2).any()):
        lonely = int(unique_ids[sizes < 2][0])
        raise ValueError(
            f"advantage estimator 'grpo_passk' needs at least 2 responses per group; group id {lonely} has 1"
        )
    # Rows ordered by group, best score first within a group (stable: the lower row first on ties).
    by_score = torch.sort(scores, descending=True, stable=True).indices
    order = by_score[torch.sort(group_index[by_score], stable=True).indices]
    starts = torch.cumsum(sizes, dim=0) - sizes
    best, second = order[starts], order[starts + 1]
    gap = scores[best] - scores[second]
    if params.norm_adv_by_std_in_grpo:
        _, stds, _ = _group_mean_std_size(scores, group_ids)
        gap = gap / (stds[best] + params.epsilon)
    per_sequence = torch.zeros_like(scores).index_copy_(0, best, gap)
    return _outcome(per_sequence, inputs)
