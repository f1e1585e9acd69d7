"""Advantage estimators: token-level rewards (and values) -> advantages and returns.

Contract: ``compute_advantages(name, inputs, gamma=..., lam=...)`` looks the estimator up in
``ADV_ESTIMATORS`` and runs it without gradient on the whole batch (group statistics and batch
whitening need every sample, so this runs where the full batch is, not per micro-batch). Every
estimator returns advantages and returns of shape ``[batch, response_len]`` that are exactly zero on
masked positions. Names and semantics follow verl's ``adv_estimator`` values.

Estimators:

- ``gae`` (Schulman et al. 2016): reverse recursion ``δ_t = r_t + γ V_{t+1} - V_t``,
  ``A_t = δ_t + γλ A_{t+1}`` over valid tokens only (a masked token is skipped: it neither
  discounts nor contributes, its value is never read); returns = raw advantages + values; the
  advantages are then whitened over all valid tokens of the batch.
- ``grpo`` (Shao et al. 2024): outcome score = sum of the token rewards of a sequence;
  ``(score - group mean) / (group std + epsilon)`` with the unbiased std, or ``score - group mean``
  when ``norm_adv_by_std_in_grpo=False`` (Dr. GRPO, Liu et al. 2025). As in verl a group of one
  sample has mean 0 and std 1, so its advantage is its score (divided by ``1 + epsilon``).
- ``rloo`` (Ahmadian et al. 2024): score minus the mean score of the other samples of its group,
  computed as ``(score - group mean) * n / (n - 1)``; a group of one keeps its raw score (verl).
- ``reinforce_plus_plus`` (Hu 2025): discounted reward-to-go over valid tokens, whitened over the
  batch; returns are the un-whitened reward-to-go.
- ``reinforce_plus_plus_baseline``: score minus group mean (0 for a group of one), broadcast over
  the valid tokens, whitened over the batch.

Departures from verl: (1) rewards on masked positions are ignored (verl sums them into the outcome
score); (2) ``reinforce_plus_plus`` skips masked tokens like GAE does, where verl resets the running
return to 0 at a masked token, which, for interior masks such as tool-output tokens of a multi-turn
rollout, cuts the credit of earlier turns; with tail padding only both agree; (3) ``gae`` returns are
zero on masked positions (verl leaves ``advantage + value`` there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rltrain.algo.masked import masked_sum, masked_whiten
from rltrain.algo.registry import Registry


@dataclass
class AdvantageInputs:
    """What an advantage estimator reads; one row per response."""

    token_level_rewards: torch.Tensor
    """``[batch, response_len]`` float: reward per response token (outcome score at the last token,
    minus the KL penalty when it is applied in the reward)."""

    response_mask: torch.Tensor
    """``[batch, response_len]`` 0/1: 1 on generated tokens that count, 0 on padding."""

    values: torch.Tensor | None = None
    """``[batch, response_len]`` float: critic values V(s_t); required by ``gae`` only."""

    group_ids: torch.Tensor | None = None
    """``[batch]`` integer: responses to the same prompt share an id; required by ``grpo``,
    ``rloo`` and ``reinforce_plus_plus_baseline``."""


@dataclass
class AdvantageOutput:
    """Result of an advantage estimator; both tensors are zero on masked positions."""

    advantages: torch.Tensor
    """``[batch, response_len]`` float: the per-token advantage used by the policy loss."""

    returns: torch.Tensor
    """``[batch, response_len]`` float: value targets for the critic (``gae``); the other
    estimators return their un-whitened return or their advantages, as verl does."""


@dataclass(frozen=True)
class AdvantageParams:
    """Hyper-parameters shared by all estimators; each reads the ones it needs."""

    gamma: float
    """Discount factor γ (``gae``, ``reinforce_plus_plus``)."""

    lam: float
    """GAE λ (``gae``)."""

    norm_adv_by_std_in_grpo: bool = True
    """Divide by the group std in ``grpo`` (False gives Dr. GRPO's mean-only baseline)."""

    epsilon: float = 1e-6
    """Added to the group std in ``grpo``."""


AdvantageEstimator = Callable[[AdvantageInputs, AdvantageParams], AdvantageOutput]

ADV_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


@torch.no_grad()
def compute_advantages(
    name: str,
    inputs: AdvantageInputs,
    *,
    gamma: float,
    lam: float,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> AdvantageOutput:
    """Run the estimator registered as ``name`` (e.g. ``"gae"``, ``"grpo"``) on the full batch.

    Args:
        name: a name in ``ADV_ESTIMATORS``.
        inputs: rewards ``[batch, response_len]``, mask ``[batch, response_len]``, and values
            ``[batch, response_len]`` / group ids ``[batch]`` where the estimator needs them.
        gamma, lam, norm_adv_by_std_in_grpo, epsilon: see ``AdvantageParams``.

    Returns:
        Advantages and returns, each ``[batch, response_len]``, zero on masked positions.
    """
    estimator = ADV_ESTIMATORS.get(name)
    _check_shapes(inputs)
    params = AdvantageParams(
        gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, epsilon=epsilon
    )
    return estimator(inputs, params)


def _check_shapes(inputs: AdvantageInputs) -> None:
    rewards = inputs.token_level_rewards
    if rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must be [batch, response_len], got {tuple(rewards.shape)}")
    if inputs.response_mask.shape != rewards.shape:
        raise ValueError(
            f"response_mask {tuple(inputs.response_mask.shape)} does not match "
            f"token_level_rewards {tuple(rewards.shape)}"
        )
    if inputs.values is not None and inputs.values.shape != rewards.shape:
        raise ValueError(
            f"values {tuple(inputs.values.shape)} does not match token_level_rewards {tuple(rewards.shape)}"
        )
    if inputs.group_ids is not None:
        if inputs.group_ids.shape != rewards.shape[:1]:
            raise ValueError(
                f"group_ids must be [batch]={rewards.shape[0]}, got {tuple(inputs.group_ids.shape)}"
            )
        if inputs.group_ids.is_floating_point():
            raise ValueError(f"group_ids must be an integer tensor, got {inputs.group_ids.dtype}")


def _require(tensor: torch.Tensor | None, field: str, estimator: str) -> torch.Tensor:
    if tensor is None:
        raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInputs.{field}, which is None")
    return tensor


def _outcome_scores(inputs: AdvantageInputs) -> torch.Tensor:
    """``[batch]``: sum of each response's token rewards over its valid tokens."""
    return masked_sum(inputs.token_level_rewards, inputs.response_mask, dim=-1)


def _group_mean_std_size(
    scores: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample statistics of its group, each ``[batch]``.

    Mean and unbiased std of the scores in the sample's group and the group size; a group of one
    gets mean 0 and std 1 (verl's convention).
    """
    unique_ids, group_index = torch.unique(group_ids, return_inverse=True)
    num_groups = unique_ids.numel()
    sizes = torch.bincount(group_index, minlength=num_groups).to(scores.dtype)
    means = scores.new_zeros(num_groups).index_add_(0, group_index, scores) / sizes
    squared = (scores - means[group_index]) ** 2
    variances = scores.new_zeros(num_groups).index_add_(0, group_index, squared) / (sizes - 1).clamp(min=1)
    single = sizes == 1
    means = torch.where(single, torch.zeros_like(means), means)
    stds = torch.where(single, torch.ones_like(variances), variances.sqrt())
    return means[group_index], stds[group_index], sizes[group_index]


def _per_token(per_sequence: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast ``[batch]`` over the valid tokens of ``[batch, response_len]``, zero elsewhere."""
    return per_sequence.unsqueeze(-1) * response_mask.to(per_sequence.dtype)


@ADV_ESTIMATORS.register("gae")
def gae(inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Generalized advantage estimation; advantages whitened over valid tokens.

    Shapes: rewards, values, mask ``[batch, response_len]`` -> advantages, returns
    ``[batch, response_len]``.
    """
    values = _require(inputs.values, "values", "gae")
    rewards = inputs.token_level_rewards
    valid = inputs.response_mask.bool()
    raw_advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    next_advantage = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + params.gamma * next_value - values[:, t]
        advantage_t = delta + params.gamma * params.lam * next_advantage
        # torch.where, not mask arithmetic: padding may hold non-finite values.
        next_advantage = torch.where(valid[:, t], advantage_t, next_advantage)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        raw_advantages[:, t] = next_advantage
    mask = valid.to(rewards.dtype)
    returns = torch.where(valid, raw_advantages + values, torch.zeros_like(rewards))
    advantages = masked_whiten(raw_advantages * mask, mask) * mask
    return AdvantageOutput(advantages=advantages, returns=returns)


@ADV_ESTIMATORS.register("grpo")
def grpo(inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Group-normalized outcome advantage (GRPO, or Dr. GRPO without the std).

    Shapes: rewards, mask ``[batch, response_len]``, group ids ``[batch]`` -> advantages = returns
    ``[batch, response_len]``.
    """
    group_ids = _require(inputs.group_ids, "group_ids", "grpo")
    scores = _outcome_scores(inputs)
    means, stds, _ = _group_mean_std_size(scores, group_ids)
    centered = scores - means
    if params.norm_adv_by_std_in_grpo:
        centered = centered / (stds + params.epsilon)
    advantages = _per_token(centered, inputs.response_mask)
    return AdvantageOutput(advantages=advantages, returns=advantages)


@ADV_ESTIMATORS.register("rloo")
def rloo(inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """REINFORCE leave-one-out: score minus the mean of the other scores of the group.

    Shapes: rewards, mask ``[batch, response_len]``, group ids ``[batch]`` -> advantages = returns
    ``[batch, response_len]``.
    """
    group_ids = _require(inputs.group_ids, "group_ids", "rloo")
    scores = _outcome_scores(inputs)
    means, _, sizes = _group_mean_std_size(scores, group_ids)
    # For a group of one, means is 0 and the factor 1: the raw score is kept (verl).
    factor = torch.where(sizes > 1, sizes / (sizes - 1).clamp(min=1), torch.ones_like(sizes))
    advantages = _per_token((scores - means) * factor, inputs.response_mask)
    return AdvantageOutput(advantages=advantages, returns=advantages)


@ADV_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus(inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Discounted reward-to-go over valid tokens, whitened over the batch.

    Shapes: rewards, mask ``[batch, response_len]`` -> advantages, returns ``[batch, response_len]``.
    """
    rewards = inputs.token_level_rewards
    valid = inputs.response_mask.bool()
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + params.gamma * running, running)
        returns[:, t] = running
    mask = valid.to(rewards.dtype)
    returns = returns * mask
    advantages = masked_whiten(returns, mask) * mask
    return AdvantageOutput(advantages=advantages, returns=returns)


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Score minus group mean, broadcast over valid tokens, whitened over the batch.

    Shapes: rewards, mask ``[batch, response_len]``, group ids ``[batch]`` -> advantages = returns
    ``[batch, response_len]``.
    """
    group_ids = _require(inputs.group_ids, "group_ids", "reinforce_plus_plus_baseline")
    scores = _outcome_scores(inputs)
    means, _, _ = _group_mean_std_size(scores, group_ids)
    mask = inputs.response_mask.to(scores.dtype)
    centered = _per_token(scores - means, mask)
    advantages = masked_whiten(centered, mask) * mask
    return AdvantageOutput(advantages=advantages, returns=advantages)
