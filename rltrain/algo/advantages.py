"""Advantage estimators: token-level rewards (and values) -> advantages and returns.

Contract: an estimator is a function registered with :func:`register_adv_estimator` under its
``algorithm.adv_estimator`` name, declaring the optional ``AdvantageInputs`` it reads (``values``:
it needs a critic; ``group_ids``: it compares the samples of one prompt; ``reward_baselines``).
``compute_advantages(name, inputs, gamma=..., lam=...)`` looks the estimator up in
``ADV_ESTIMATORS`` and runs it without gradient on the whole batch (group statistics and batch
whitening need every sample, so this runs where the full batch is, not per micro-batch). Every
estimator returns advantages and returns of shape ``[batch, response_len]`` that are exactly zero on
masked positions. Names and semantics follow verl's ``adv_estimator`` values. An estimator that
needs an input the caller left out (``values``, ``group_ids``, ``reward_baselines``) fails with one
line naming the estimator and the missing ``AdvantageInputs`` field.

Estimators of this module (per-token returns; the group estimators ``grpo``, ``rloo``,
``reinforce_plus_plus_baseline``, ``opo``, ``gpg`` and ``grpo_passk`` are in
:mod:`rltrain.algo.advantages_group`, which this module imports so that every name is registered):

- ``gae`` (Schulman et al. 2016): reverse recursion ``δ_t = r_t + γ V_{t+1} - V_t``,
  ``A_t = δ_t + γλ A_{t+1}`` over valid tokens only (a masked token is skipped: it neither
  discounts nor contributes, its value is never read); returns = raw advantages + values; the
  advantages are then whitened over all valid tokens of the batch.
- ``reinforce_plus_plus`` (Hu 2025): discounted reward-to-go over valid tokens, whitened over the
  batch; returns are the un-whitened reward-to-go.
- ``remax`` (Li et al. 2023, arXiv:2310.10505): undiscounted reward-to-go over valid tokens minus
  ``reward_baselines``, the reward of the greedy response to the same prompt, on every valid token:
  ``A_t = Σ_{s≥t, valid} r_s - b``; returns are the reward-to-go. Not whitened; γ is not used
  (verl's ``compute_remax_outcome_advantage`` ignores it too). The caller generates the greedy
  baseline; the estimator needs no group ids and works for any ``rollout.n``.

``reinforce_plus_plus`` and ``gae`` skip a masked token (a tool-output token of a multi-turn
rollout, or padding): its reward is not added and the running return passes it undiscounted. verl
does the same for GAE and, since 0.9.0 (verl PR #7300, issue #7278), for REINFORCE++; older verl
reset REINFORCE++'s running return to 0 there, cutting the credit of earlier turns.

Departures from verl: (1) rewards on masked positions are ignored with ``torch.where``; verl
multiplies them by the mask, which ignores them as well unless they are not finite (``nan · 0`` is
``nan``); (2) ``gae`` returns are zero on masked positions (verl leaves ``advantage + value``
there); (3) ``remax`` advantages are zero on interior masked positions, where verl leaves the
reward-to-go (its baseline term is masked, its reward-to-go is not); with tail padding only both
agree.
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
    ``rloo``, ``reinforce_plus_plus_baseline``, ``opo``, ``gpg`` and ``grpo_passk``."""

    reward_baselines: torch.Tensor | None = None
    """``[batch]`` float: reward of the greedy (``do_sample=False``) response to each sample's prompt,
    repeated for the ``n`` samples of that prompt; required by ``remax`` only."""


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
    """Divide by the group std in ``grpo`` (False gives Dr. GRPO's mean-only baseline) and in
    ``grpo_passk``."""

    epsilon: float = 1e-6
    """Added to the group std in ``grpo`` and ``grpo_passk``."""


AdvantageEstimator = Callable[[AdvantageInputs, AdvantageParams], AdvantageOutput]

OPTIONAL_INPUTS = ("values", "group_ids", "reward_baselines")
"""The ``AdvantageInputs`` fields an estimator may declare it needs."""


@dataclass(frozen=True)
class RegisteredEstimator:
    """An advantage estimator and the optional inputs it reads."""

    estimator: AdvantageEstimator
    needs: frozenset[str]
    """Names in :data:`OPTIONAL_INPUTS`: ``values`` means a critic is trained for it, ``group_ids``
    that it needs several samples per prompt (``rollout.n >= 2``)."""


ADV_ESTIMATORS: Registry[RegisteredEstimator] = Registry("advantage estimator")


def register_adv_estimator(
    name: str, *, needs: tuple[str, ...] = ()
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: register the estimator as ``name`` (the value of ``algorithm.adv_estimator``),
    reading the optional ``AdvantageInputs`` fields ``needs``; returns the function unchanged."""
    unknown = sorted(set(needs) - set(OPTIONAL_INPUTS))
    if unknown:
        raise ValueError(
            f"advantage estimator {name!r}: needs {unknown} are not among {', '.join(OPTIONAL_INPUTS)}"
        )

    def decorator(estimator: AdvantageEstimator) -> AdvantageEstimator:
        ADV_ESTIMATORS.register(name)(RegisteredEstimator(estimator, frozenset(needs)))
        return estimator

    return decorator


def estimator_needs(name: str) -> frozenset[str]:
    """The optional inputs the estimator ``name`` reads; ``UnknownNameError`` naming the closest
    registered name when there is none."""
    return ADV_ESTIMATORS.get(name).needs


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
    estimator = ADV_ESTIMATORS.get(name).estimator
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
    baselines = inputs.reward_baselines
    if baselines is not None:
        if baselines.shape != rewards.shape[:1]:
            raise ValueError(
                f"reward_baselines must be [batch]={rewards.shape[0]}, got {tuple(baselines.shape)}"
            )
        if not baselines.is_floating_point():
            raise ValueError(f"reward_baselines must be a float tensor, got {baselines.dtype}")


def require_input(tensor: torch.Tensor | None, field: str, estimator: str) -> torch.Tensor:
    """``tensor``, or a one-line error naming the estimator and the missing ``AdvantageInputs`` field."""
    if tensor is None:
        raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInputs.{field}, which is None")
    return tensor


def outcome_scores(inputs: AdvantageInputs) -> torch.Tensor:
    """``[batch]``: sum of each response's token rewards over its valid tokens."""
    return masked_sum(inputs.token_level_rewards, inputs.response_mask, dim=-1)


def per_token(per_sequence: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast ``[batch]`` over the valid tokens of ``[batch, response_len]``, zero elsewhere."""
    return per_sequence.unsqueeze(-1) * response_mask.to(per_sequence.dtype)


@register_adv_estimator("gae", needs=("values",))
def gae(inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Generalized advantage estimation; advantages whitened over valid tokens.

    Shapes: rewards, values, mask ``[batch, response_len]`` -> advantages, returns
    ``[batch, response_len]``.
    """
    values = require_input(inputs.values, "values", "gae")
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


@register_adv_estimator("reinforce_plus_plus")
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


@register_adv_estimator("remax", needs=("reward_baselines",))
def remax(inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """ReMax: reward-to-go over valid tokens minus the greedy response's reward.

    Shapes: rewards, mask ``[batch, response_len]``, reward baselines ``[batch]`` -> advantages,
    returns ``[batch, response_len]``.
    """
    baselines = require_input(inputs.reward_baselines, "reward_baselines", "remax")
    rewards = inputs.token_level_rewards
    valid = inputs.response_mask.bool()
    # torch.where, not mask arithmetic: padding may hold non-finite values.
    kept = torch.where(valid, rewards, torch.zeros_like(rewards))
    reward_to_go = kept.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    zeros = torch.zeros_like(rewards)
    returns = torch.where(valid, reward_to_go, zeros)
    advantages = torch.where(valid, reward_to_go - baselines.to(rewards.dtype).unsqueeze(-1), zeros)
    return AdvantageOutput(advantages=advantages, returns=returns)


# The group estimators register themselves with register_adv_estimator, defined above.
from rltrain.algo import advantages_group  # noqa: E402, F401
