"""KL between the policy and the reference: per-token estimators, the β controllers, KL in reward.

Contract: ``kl_penalty(logprobs, ref_logprobs, kind)`` returns a per-token estimate
``[batch, response_len]`` of KL(π || π_ref) from the log-probabilities of the sampled tokens; kinds
are registered in ``KL_ESTIMATORS`` under verl's names (``algorithm.kl_penalty`` /
``actor.kl_loss_type``), see http://joschu.net/blog/kl-approx.html:

- ``kl`` (k1): ``logp - ref_logp``; unbiased, high variance, can be negative per token.
- ``abs``: ``|logp - ref_logp|``.
- ``mse`` (k2): ``0.5 (logp - ref_logp)^2``.
- ``low_var_kl`` (k3): ``exp(ref_logp - logp) - (ref_logp - logp) - 1``; non-negative, unbiased,
  low variance. As in verl the log-ratio is clamped to ±20 before ``exp`` and the result to
  [-10, 10].

``k1``, ``k2`` and ``k3`` are verl's other names of ``kl``, ``mse`` and ``low_var_kl``. A name with a
trailing ``+`` (``k1+``, ``k3+``, ``low_var_kl+``, ...; every name above has one) is the
straight-through variant: its value is that of the estimator named without the ``+``, its gradient
w.r.t. ``logprobs`` is that of k2, ``logp - ref_logp``. k1 and k3 estimate the KL's value without
bias but their gradients do not estimate the KL's gradient; k2's does (verl PR 2953). ``k2+`` and
``mse+`` equal k2. As a reward penalty (no gradient) a ``+`` name is its base estimator. verl's
``kl_penalty`` before August 2026 looked the base estimator up by the name with the ``+`` and
raised ``NotImplementedError``; this follows its documented meaning (and later verl).

Controllers hold β (``kl_ctrl.type``): ``fixed`` keeps it, ``adaptive`` follows Ziegler et al. 2019
(``proportional_error = clip(kl / target - 1, ±0.2)``, ``β *= 1 + proportional_error · n_steps /
horizon``). Their state is plain Python floats so it goes into a checkpoint as is.

``apply_kl_in_reward`` builds verl's token-level rewards for ``use_kl_in_reward``: the outcome score
on the last valid token minus β · KL on every valid token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from rltrain.algo.masked import masked_mean, masked_sum
from rltrain.algo.registry import Registry

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


@KL_ESTIMATORS.register("kl")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = ``logprobs - ref_logprobs``; shapes ``[batch, response_len]``."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("abs")
def kl_abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``|logprobs - ref_logprobs|``; shapes ``[batch, response_len]``."""
    return (logprobs - ref_logprobs).abs()


@KL_ESTIMATORS.register("mse")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = ``0.5 (logprobs - ref_logprobs)^2``; shapes ``[batch, response_len]``."""
    return 0.5 * (logprobs - ref_logprobs).square()


@KL_ESTIMATORS.register("low_var_kl")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = ``exp(r) - r - 1`` with ``r = ref_logprobs - logprobs``, clamped as verl does.

    Shapes ``[batch, response_len]``.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(min=-20.0, max=20.0)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(min=-10.0, max=10.0)


KL_ESTIMATORS.register("k1")(kl_k1)
KL_ESTIMATORS.register("k2")(kl_k2)
KL_ESTIMATORS.register("k3")(kl_k3)


def straight_through(estimator: KLEstimator) -> KLEstimator:
    """The ``+`` variant of ``estimator``: its value, the gradient of k2 (``logprobs - ref_logprobs``)."""

    def estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
        value = estimator(logprobs, ref_logprobs)
        k2 = kl_k2(logprobs, ref_logprobs)
        return k2 - k2.detach() + value.detach()

    estimate.__doc__ = f"Value of ``{estimator.__name__}``, gradient of k2; shapes ``[batch, response_len]``."
    return estimate


def _register_straight_through_variants() -> None:
    for name in KL_ESTIMATORS.names():
        KL_ESTIMATORS.register(f"{name}+")(straight_through(KL_ESTIMATORS.get(name)))


_register_straight_through_variants()


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of kind ``kind`` (a name in ``KL_ESTIMATORS``).

    Args:
        logprobs: ``[batch, response_len]`` log π(token) of the policy.
        ref_logprobs: ``[batch, response_len]`` log π_ref(token) of the reference.
        kind: a name in ``KL_ESTIMATORS``: ``"kl"``/``"k1"``, ``"abs"``, ``"mse"``/``"k2"``,
            ``"low_var_kl"``/``"k3"``, each also with a trailing ``+`` (straight-through).

    Returns:
        ``[batch, response_len]``, not masked.
    """
    return KL_ESTIMATORS.get(kind)(logprobs, ref_logprobs)


class KLController(Protocol):
    """Holds the KL coefficient β and updates it once per training step."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


class FixedKLController:
    """β stays at ``kl_coef``."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: a fixed coefficient ignores the measured KL."""

    def state_dict(self) -> dict[str, float]:
        """``{"value": β}`` as a plain float, for the checkpoint."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore β from ``state_dict()``; the other settings come from the config."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """β adapted towards a target KL (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0:
            raise ValueError(f"adaptive KL controller needs target_kl > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"adaptive KL controller needs horizon > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale β by ``1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``.

        Args:
            current_kl: the KL measured on this step's batch (verl: per-sequence token-mean KL,
                averaged over the batch).
            n_steps: samples in this step's batch (verl passes the batch size).
        """
        proportional_error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """``{"value": β}`` as a plain float, for the checkpoint."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore β from ``state_dict()``; the other settings come from the config."""
        self.value = float(state["value"])


KLControllerFactory = Callable[..., KLController]

KL_CONTROLLERS: Registry[KLControllerFactory] = Registry("KL controller")


@KL_CONTROLLERS.register("fixed")
def _build_fixed(*, kl_coef: float, target_kl: float | None, horizon: float | None) -> KLController:
    """``FixedKLController(kl_coef)``; ``target_kl`` and ``horizon`` are ignored."""
    return FixedKLController(kl_coef)


@KL_CONTROLLERS.register("adaptive")
def _build_adaptive(*, kl_coef: float, target_kl: float | None, horizon: float | None) -> KLController:
    """``AdaptiveKLController`` starting at ``kl_coef``; needs ``target_kl`` and ``horizon``."""
    if target_kl is None or horizon is None:
        raise ValueError(
            f"kl_ctrl.type='adaptive' needs kl_ctrl.target_kl and kl_ctrl.horizon, "
            f"got target_kl={target_kl}, horizon={horizon}"
        )
    return AdaptiveKLController(kl_coef, target_kl, horizon)


def build_kl_controller(
    type: str, *, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> KLController:
    """The controller named by verl's ``kl_ctrl.type`` (``"fixed"`` or ``"adaptive"``).

    ``target_kl`` and ``horizon`` are required for ``adaptive`` and ignored by ``fixed``.
    """
    return KL_CONTROLLERS.get(type)(kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)


@dataclass
class KLInRewardMetrics:
    """Batch statistics of the KL put into the reward (plain floats, for logging and β updates)."""

    kl_token_mean: float
    """KL averaged over each sequence's valid tokens, then over the batch: verl's
    ``actor/reward_kl_penalty``, the value verl feeds to ``KLController.update``."""

    kl_seq_sum: float
    """KL summed over each sequence's valid tokens, then averaged over the batch (the KL of a whole
    response)."""

    kl_coef: float
    """β that was applied (verl's ``actor/reward_kl_penalty_coeff``)."""


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """``[batch]`` long: position of the last valid token of each row of ``[batch, response_len]``.

    Raises ``ValueError`` naming the rows that have no valid token.
    """
    valid = response_mask.bool()
    empty = ~valid.any(dim=-1)
    if bool(empty.any()):
        rows = empty.nonzero().flatten().tolist()
        raise ValueError(f"response_mask rows {rows} have no valid token; cannot place their score")
    positions = torch.arange(valid.shape[-1], device=valid.device).expand_as(valid)
    return torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=-1).values


@torch.no_grad()
def apply_kl_in_reward(
    *,
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str,
) -> tuple[torch.Tensor, KLInRewardMetrics]:
    """Token-level rewards for ``use_kl_in_reward``: score at the last token minus β·KL per token.

    Args:
        scores: ``[batch]`` outcome score of each response.
        logprobs: ``[batch, response_len]`` log-probs of the sampling policy (verl: old_log_probs).
        ref_logprobs: ``[batch, response_len]`` log-probs of the reference policy.
        response_mask: ``[batch, response_len]`` 0/1; every row needs a valid token.
        kl_coef: β, usually ``KLController.value``.
        kind: KL estimator name (``algorithm.kl_penalty``).

    Returns:
        ``token_level_rewards`` ``[batch, response_len]`` (zero on masked positions) and metrics.
    """
    mask = response_mask.to(logprobs.dtype)
    kl = kl_penalty(logprobs, ref_logprobs, kind) * mask
    rewards = -kl_coef * kl
    last = last_token_index(response_mask)
    rewards[torch.arange(rewards.shape[0], device=rewards.device), last] += scores.to(rewards.dtype)
    metrics = KLInRewardMetrics(
        kl_token_mean=masked_mean(kl, mask, dim=-1).mean().item(),
        kl_seq_sum=masked_sum(kl, mask, dim=-1).mean().item(),
        kl_coef=float(kl_coef),
    )
    return rewards, metrics
