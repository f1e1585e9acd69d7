"""sapo, dro, dppo_tv and dppo_kl against verl 0.9.1's formulas evaluated by hand, in every
aggregation mode, and their micro-batch split invariance.

Every hand batch has three rows of three tokens: row 0 holds two tokens, row 1 is empty, row 2
holds three. Padding carries garbage (log-prob -7, log-ratio 3, advantage 9) that must not leak into
a loss, a gradient or a metric. Each test derives each valid token's loss ``l_t`` and its derivative
``g_t = dl_t/dlogp_t`` by hand; verl's ``agg_loss`` then weighs token ``t`` by ``w_t`` below (5 valid
tokens, 2 non-empty rows of 2 and 3 tokens, response length 3), so the loss is ``Σ w_t l_t`` and the
gradient ``w_t g_t``.
"""

import math
import re

import pytest
import torch

from rltrain.algo.loss_agg import LossAgg
from rltrain.algo.losses import PolicyLossInputs, PolicyLossParams
from tests.unit.algo.hand_batches import grid, run_loss, split_vs_full

MASK = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
VALID = [(0, 0), (0, 1), (2, 0), (2, 1), (2, 2)]
MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGG_WEIGHTS = {
    "token-mean": [1 / 5] * 5,
    "token-sum": [1.0] * 5,
    "seq-mean-token-sum": [1 / 2] * 5,
    "seq-mean-token-mean": [1 / 4, 1 / 4, 1 / 6, 1 / 6, 1 / 6],
    "seq-mean-token-sum-norm": [1 / 6] * 5,  # (token sum / 3) / 2 sequences
}


def _grid(values: list[float], padding: float) -> torch.Tensor:
    return grid(VALID, (3, 3), values, padding)


def _inputs(
    logprobs: list[float], old_logprobs: list[float], advantages: list[float], **extra: torch.Tensor
) -> PolicyLossInputs:
    logp = _grid(logprobs, -7.0)
    return PolicyLossInputs(
        old_logprobs=_grid(old_logprobs, -10.0),
        logprobs=logp.requires_grad_(),
        advantages=_grid(advantages, 9.0),
        response_mask=MASK,
        **extra,
    )


def _assert_aggregated(out, grad, mode: str, losses: list[float], grads: list[float]) -> None:
    """The loss is ``Σ w_t l_t`` and the gradient ``w_t g_t`` with ``mode``'s weights."""
    weights = AGG_WEIGHTS[mode]
    assert out.loss.item() == pytest.approx(sum(w * v for w, v in zip(weights, losses)), rel=1e-12)
    expected = _grid([w * g for w, g in zip(weights, grads)], 0.0).tolist()
    assert grad.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in expected]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# -- sapo ------------------------------------------------------------------------------------------

SAPO_LOGPROBS = [-1.0, -2.0, -0.5, -0.2, -3.0]
SAPO_LOG_RATIOS = [0.0, 0.5, 0.0, -0.3, 0.2]
SAPO_ADVANTAGES = [1.0, 1.0, -1.0, -1.0, 0.0]


def _sapo_token(log_ratio: float, advantage: float, tau: float) -> tuple[float, float]:
    """``l = -A σ(τ(r - 1)) 4/τ`` and ``dl/dlogp = -A · 4 σ(1 - σ) r`` with ``r = e^log_ratio``."""
    ratio = math.exp(log_ratio)
    s = _sigmoid(tau * (ratio - 1.0))
    return -advantage * s * 4.0 / tau, -advantage * 4.0 * s * (1.0 - s) * ratio


@pytest.mark.parametrize("mode", MODES)
def test_sapo_gates_the_ratio_and_ignores_loss_agg_mode_as_verl(mode):
    old = [lp - d for lp, d in zip(SAPO_LOGPROBS, SAPO_LOG_RATIOS)]
    inputs = _inputs(SAPO_LOGPROBS, old, SAPO_ADVANTAGES)
    out, grad = run_loss("sapo", inputs, LossAgg(mode=mode), tau_pos=1.0, tau_neg=2.0)
    # τ = 1 for A > 0 (tokens 0, 1), τ = 2 for A <= 0 (tokens 2, 3, 4; A = 0 gives 0 either way)
    taus = [1.0, 1.0, 2.0, 2.0, 2.0]
    terms = [_sapo_token(d, a, t) for d, a, t in zip(SAPO_LOG_RATIOS, SAPO_ADVANTAGES, taus)]
    losses, grads = [t[0] for t in terms], [t[1] for t in terms]
    # at r = 1 the gate is 2/τ and its gradient the policy gradient's -A
    assert terms[0] == pytest.approx((-2.0, -1.0)) and terms[2] == pytest.approx((1.0, 1.0))
    _assert_aggregated(out, grad, "seq-mean-token-mean", losses, grads)
    assert out.clipfrac.item() == 0.0 and out.clipfrac_lower.item() == 0.0
    assert out.ppo_kl.item() == pytest.approx(-sum(SAPO_LOG_RATIOS) / 5, rel=1e-12)


def test_sapo_default_temperatures_are_verls():
    params = PolicyLossParams()
    assert (params.tau_pos, params.tau_neg) == (1.0, 1.05)
    with pytest.raises(ValueError, match="tau_pos and tau_neg must be > 0"):
        PolicyLossParams(tau_neg=0.0)


# -- dro -------------------------------------------------------------------------------------------

DRO_LOGPROBS = [-1.0, -2.0, -0.5, -0.2, -3.0]
DRO_LOG_RATIOS = [0.2, -0.4, 0.0, 0.6, -0.2]
DRO_ADVANTAGES = [1.0, 1.0, -0.5, -0.5, -0.5]
# β = 0.5: l = -(A logp - 0.25 lr²), g = -A + 0.5 lr
DRO_LOSSES = [1.01, 2.04, -0.25, -0.01, -1.49]
DRO_GRADS = [-0.9, -1.2, 0.5, 0.8, 0.4]


@pytest.mark.parametrize("mode", MODES)
def test_dro_is_the_policy_gradient_with_a_quadratic_log_ratio_penalty(mode):
    old = [lp - d for lp, d in zip(DRO_LOGPROBS, DRO_LOG_RATIOS)]
    out, grad = run_loss("dro", _inputs(DRO_LOGPROBS, old, DRO_ADVANTAGES), LossAgg(mode=mode), dro_beta=0.5)
    _assert_aggregated(out, grad, mode, DRO_LOSSES, DRO_GRADS)
    assert out.clipfrac.item() == 0.0 and out.clipfrac_lower.item() == 0.0
    assert out.ppo_kl.item() == pytest.approx(-sum(DRO_LOG_RATIOS) / 5, rel=1e-12)


def test_dro_weights_each_token_by_its_rollout_is_weight():
    old = [lp - d for lp, d in zip(DRO_LOGPROBS, DRO_LOG_RATIOS)]
    weights = [0.5, 2.0, 1.0, 1.0, 3.0]
    inputs = _inputs(DRO_LOGPROBS, old, DRO_ADVANTAGES, rollout_is_weights=_grid(weights, 0.0))
    out, grad = run_loss("dro", inputs, LossAgg(mode="token-sum"), dro_beta=0.5)
    weighted = [w * v for w, v in zip(weights, DRO_LOSSES)]
    _assert_aggregated(out, grad, "token-sum", weighted, [w * g for w, g in zip(weights, DRO_GRADS)])
    assert out.tis_weight_mean.item() == pytest.approx(7.5 / 5)


def test_dro_refuses_to_run_without_a_positive_beta_as_verl():
    old = [lp - d for lp, d in zip(DRO_LOGPROBS, DRO_LOG_RATIOS)]
    with pytest.raises(ValueError, match=re.escape("needs actor.policy_loss.dro_beta > 0; it is null")):
        run_loss("dro", _inputs(DRO_LOGPROBS, old, DRO_ADVANTAGES), LossAgg())
    with pytest.raises(ValueError, match=re.escape("dro_beta must be > 0, got 0.0")):
        PolicyLossParams(dro_beta=0.0)


# -- dppo_tv / dppo_kl -----------------------------------------------------------------------------

DPPO_ADVANTAGES = [1.0, 1.0, -1.0, -1.0, -1.0]


def _dppo_inputs(probs: list[float], old_probs: list[float]) -> PolicyLossInputs:
    return _inputs([math.log(p) for p in probs], [math.log(p) for p in old_probs], DPPO_ADVANTAGES)


def _dppo_terms(
    probs: list[float], old_probs: list[float], kept: list[bool], cap: float
) -> tuple[list[float], list[float]]:
    """``l = -A min(r, cap) logp`` and ``g = -A min(r, cap)`` on kept tokens, 0 on dropped ones."""
    losses, grads = [], []
    for p, p_old, a, keep in zip(probs, old_probs, DPPO_ADVANTAGES, kept):
        weight = min(p / p_old, cap) if keep else 0.0
        losses.append(-a * weight * math.log(p))
        grads.append(-a * weight)
    return losses, grads


# TV with low = 0.1, high = 0.05, clip_ratio_c = 1.5:
#   token 0: A > 0, p 0.5 -> 0.6, up 0.1 > high: dropped
#   token 1: A > 0, p 0.2 -> 0.22, up 0.02 <= high: kept, r = 1.1
#   token 2: A < 0, p 0.5 -> 0.3, down 0.2 > low: dropped
#   token 3: A < 0, p 0.1 -> 0.3, up (only a fall is bounded): kept, r = 3 truncated to 1.5
#   token 4: A < 0, p 0.4 -> 0.35, down 0.05 <= low: kept, r = 0.875
TV_PROBS = [0.6, 0.22, 0.3, 0.3, 0.35]
TV_OLD_PROBS = [0.5, 0.2, 0.5, 0.1, 0.4]
TV_KEPT = [False, True, False, True, True]


@pytest.mark.parametrize("mode", MODES)
def test_dppo_tv_drops_tokens_whose_probability_moved_past_the_bound(mode):
    inputs = _dppo_inputs(TV_PROBS, TV_OLD_PROBS)
    params = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.05, "clip_ratio_c": 1.5}
    out, grad = run_loss("dppo_tv", inputs, LossAgg(mode=mode), **params)
    losses, grads = _dppo_terms(TV_PROBS, TV_OLD_PROBS, TV_KEPT, cap=1.5)
    assert grads == pytest.approx([0.0, -1.1, 0.0, 1.5, 0.875])
    _assert_aggregated(out, grad, mode, losses, grads)
    assert out.clipfrac.item() == pytest.approx(2 / 5)  # tokens 0 and 2 dropped
    assert out.clipfrac_lower.item() == pytest.approx(1 / 5)  # token 3: kept, r > clip_ratio_c
    log_ratios = [math.log(p / q) for p, q in zip(TV_PROBS, TV_OLD_PROBS)]
    assert out.ppo_kl.item() == pytest.approx(-sum(log_ratios) / 5, rel=1e-12)


def _binary_kl(old_prob: float, prob: float) -> float:
    return old_prob * math.log(old_prob / prob) + (1 - old_prob) * math.log((1 - old_prob) / (1 - prob))


# KL with low = high = 0.02, clip_ratio_c = 1.5; only a move in the direction A favours
# (A > 0: up; A < 0: down) is bounded:
#   token 0: A > 0, p 0.5 -> 0.7 up, D = 0.087 > 0.02: dropped
#   token 1: A > 0, p 0.5 -> 0.4 down: kept although D = 0.020 > 0.02, r = 0.8
#   token 2: A < 0, p 0.5 -> 0.3 down, D = 0.087 > 0.02: dropped
#   token 3: A < 0, p 0.1 -> 0.3 up: kept, r = 3 truncated to 1.5
#   token 4: A < 0, p 0.4 -> 0.38 down, D = 0.0008 <= 0.02: kept, r = 0.95
KL_PROBS = [0.7, 0.4, 0.3, 0.3, 0.38]
KL_OLD_PROBS = [0.5, 0.5, 0.5, 0.1, 0.4]
KL_KEPT = [False, True, False, True, True]


@pytest.mark.parametrize("mode", MODES)
def test_dppo_kl_drops_tokens_whose_binary_kl_passed_the_bound(mode):
    divergences = [_binary_kl(q, p) for p, q in zip(KL_PROBS, KL_OLD_PROBS)]
    assert [d > 0.02 for d in divergences] == [True, True, True, True, False]
    inputs = _dppo_inputs(KL_PROBS, KL_OLD_PROBS)
    out, grad = run_loss("dppo_kl", inputs, LossAgg(mode=mode), clip_ratio=0.02, clip_ratio_c=1.5)
    losses, grads = _dppo_terms(KL_PROBS, KL_OLD_PROBS, KL_KEPT, cap=1.5)
    assert grads == pytest.approx([0.0, -0.8, 0.0, 1.5, 0.95])
    _assert_aggregated(out, grad, mode, losses, grads)
    assert out.clipfrac.item() == pytest.approx(2 / 5)
    assert out.clipfrac_lower.item() == pytest.approx(1 / 5)


# -- split invariance ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("sapo", PolicyLossParams(tau_pos=1.0, tau_neg=2.0)),
        ("dro", PolicyLossParams(dro_beta=0.3)),
        ("dppo_tv", PolicyLossParams(clip_ratio=0.05, clip_ratio_c=1.2)),
        ("dppo_kl", PolicyLossParams(clip_ratio=0.01, clip_ratio_c=1.2)),
    ],
)
@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_losses_with_global_counts_sum_to_the_full_batch(name, params, mode):
    full, full_grad, parts = split_vs_full(name, mode, params, seed=5)
    assert sum(p.loss.item() for p, _ in parts) == pytest.approx(full.loss.item(), abs=1e-12)
    torch.testing.assert_close(torch.cat([g for _, g in parts]), full_grad, rtol=0, atol=1e-12)
    for metric in ("clipfrac", "clipfrac_lower", "ppo_kl"):
        total = sum(getattr(p, metric).item() for p, _ in parts)
        assert total == pytest.approx(getattr(full, metric).item(), abs=1e-12)
    assert abs(full.loss.item()) > 1e-3
    if name.startswith("dppo"):  # the bounds drop some tokens and keep others
        assert 0.0 < full.clipfrac.item() < 1.0
