"""KL estimators, β controllers and KL-in-reward against values computed with math."""

import math

import pytest
import torch

from rltrain.algo.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    build_kl_controller,
    kl_penalty,
)
from rltrain.algo.loss_agg import LossAgg
from rltrain.algo.losses import compute_kl_loss

LOGPROBS = torch.tensor([[-1.0, -2.0, -0.25]], dtype=torch.float64)
REF_LOGPROBS = torch.tensor([[-1.5, -0.5, -0.25]], dtype=torch.float64)
POINTS = [(-1.0, -1.5), (-2.0, -0.5), (-0.25, -0.25)]


def _k3(logp: float, ref: float) -> float:
    r = ref - logp
    return math.exp(r) - r - 1.0


@pytest.mark.parametrize(
    ("kind", "formula"),
    [
        ("kl", lambda lp, ref: lp - ref),
        ("abs", lambda lp, ref: abs(lp - ref)),
        ("mse", lambda lp, ref: 0.5 * (lp - ref) ** 2),
        ("low_var_kl", _k3),
    ],
)
def test_estimators_at_chosen_points(kind, formula):
    expected = [formula(lp, ref) for lp, ref in POINTS]
    assert kl_penalty(LOGPROBS, REF_LOGPROBS, kind).tolist() == [pytest.approx(expected, abs=1e-15)]


def test_hand_values():
    assert kl_penalty(LOGPROBS, REF_LOGPROBS, "kl")[0, 0].item() == pytest.approx(0.5)
    assert kl_penalty(LOGPROBS, REF_LOGPROBS, "mse")[0, 1].item() == pytest.approx(1.125)
    assert kl_penalty(LOGPROBS, REF_LOGPROBS, "low_var_kl")[0, 0].item() == pytest.approx(
        math.exp(-0.5) + 0.5 - 1.0
    )


def test_low_var_kl_is_clamped_to_ten():
    logprobs = torch.tensor([[-30.0, 0.0, -12.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, -30.0, 0.0]], dtype=torch.float64)
    got = kl_penalty(logprobs, ref, "low_var_kl").tolist()[0]
    # r = 30 -> exp(20) - 21 before the clamp; r = -30 -> exp(-20) + 19; r = 12 -> exp(12) - 13
    assert got == [10.0, 10.0, 10.0]
    assert _k3(-30.0, 0.0) > 10 and _k3(0.0, -30.0) > 10 and _k3(-12.0, 0.0) > 10
    small = kl_penalty(torch.tensor([-1.0]), torch.tensor([-3.0]), "low_var_kl").item()
    assert small == pytest.approx(_k3(-1.0, -3.0), rel=1e-6)  # 1.135..., below the clamp


def test_unknown_estimator():
    with pytest.raises(KeyError, match="did you mean 'low_var_kl'"):
        kl_penalty(LOGPROBS, REF_LOGPROBS, "low_var")


def test_adaptive_controller_raises_beta_when_kl_above_target():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    ctrl.update(current_kl=1.1, n_steps=10)  # error 0.1 -> mult 1 + 0.1·10/100
    assert ctrl.value == pytest.approx(0.1 * 1.01, rel=1e-12)


def test_adaptive_controller_lowers_beta_when_kl_below_target():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    ctrl.update(current_kl=0.95, n_steps=20)  # error -0.05 -> mult 1 - 0.05·20/100
    assert ctrl.value == pytest.approx(0.1 * 0.99, rel=1e-12)


@pytest.mark.parametrize(("current_kl", "clipped_error"), [(5.0, 0.2), (0.0, -0.2), (1.2, 0.2)])
def test_adaptive_controller_clips_the_error(current_kl, clipped_error):
    ctrl = AdaptiveKLController(init_kl_coef=0.05, target_kl=1.0, horizon=50)
    ctrl.update(current_kl=current_kl, n_steps=25)
    assert ctrl.value == pytest.approx(0.05 * (1.0 + clipped_error * 25 / 50), rel=1e-12)


def test_adaptive_controller_state_round_trip():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.5, horizon=1000)
    for kl in (0.9, 0.2, 0.7):
        ctrl.update(current_kl=kl, n_steps=64)
    state = ctrl.state_dict()
    assert all(type(v) is float for v in state.values())
    restored = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.5, horizon=1000)
    restored.load_state_dict(state)
    assert restored.value == ctrl.value
    ctrl.update(current_kl=1.0, n_steps=64)
    restored.update(current_kl=1.0, n_steps=64)
    assert restored.value == ctrl.value


def test_fixed_controller_stays_fixed():
    ctrl = FixedKLController(kl_coef=0.02)
    for kl in (0.0, 5.0, 100.0):
        ctrl.update(current_kl=kl, n_steps=256)
    assert ctrl.value == 0.02
    restored = FixedKLController(kl_coef=0.5)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == 0.02


def test_build_kl_controller():
    fixed = build_kl_controller("fixed", kl_coef=0.001, target_kl=0.1, horizon=10000)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.001
    adaptive = build_kl_controller("adaptive", kl_coef=0.001, target_kl=0.1, horizon=10000)
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target_kl, adaptive.horizon) == (0.001, 0.1, 10000.0)
    with pytest.raises(ValueError, match=r"needs kl_ctrl\.target_kl and kl_ctrl\.horizon"):
        build_kl_controller("adaptive", kl_coef=0.001)
    with pytest.raises(ValueError, match="horizon > 0"):
        build_kl_controller("adaptive", kl_coef=0.001, target_kl=0.1, horizon=0)
    with pytest.raises(KeyError, match="registered: adaptive, fixed; did you mean 'adaptive'"):
        build_kl_controller("adaptve", kl_coef=0.001)


def test_apply_kl_in_reward_hand_example():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -0.4, -9.0, -9.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-0.3, -0.1, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    scores = torch.tensor([1.0, -0.5], dtype=torch.float64)
    rewards, metrics = apply_kl_in_reward(
        scores=scores, logprobs=logprobs, ref_logprobs=ref, response_mask=mask, kl_coef=0.1, kind="kl"
    )
    # k1 on valid tokens: row 0: 0.5, -1.0, 0.0; row 1: 0.1, -0.3
    expected = [
        [-0.1 * 0.5, -0.1 * -1.0, 1.0 - 0.1 * 0.0, 0.0],
        [-0.1 * 0.1, -0.5 - 0.1 * -0.3, 0.0, 0.0],
    ]
    assert rewards.tolist() == [pytest.approx(row, abs=1e-15) for row in expected]
    assert metrics.kl_token_mean == pytest.approx(((0.5 - 1.0 + 0.0) / 3 + (0.1 - 0.3) / 2) / 2)
    assert metrics.kl_seq_sum == pytest.approx(((0.5 - 1.0 + 0.0) + (0.1 - 0.3)) / 2)
    assert metrics.kl_coef == 0.1


def test_apply_kl_in_reward_with_interior_mask_and_low_var_kl():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -0.5]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1]])
    rewards, _ = apply_kl_in_reward(
        scores=torch.tensor([2.0], dtype=torch.float64),
        logprobs=logprobs,
        ref_logprobs=ref,
        response_mask=mask,
        kl_coef=0.5,
        kind="low_var_kl",
    )
    assert rewards.tolist() == [pytest.approx([-0.5 * _k3(-1.0, -1.5), 0.0, 2.0], abs=1e-15)]


def test_apply_kl_in_reward_rejects_empty_response():
    with pytest.raises(ValueError, match=r"rows \[1\] have no valid token"):
        apply_kl_in_reward(
            scores=torch.zeros(2),
            logprobs=torch.zeros(2, 3),
            ref_logprobs=torch.zeros(2, 3),
            response_mask=torch.tensor([[1, 0, 0], [0, 0, 0]]),
            kl_coef=0.1,
            kind="kl",
        )


FORMULAS = {
    "kl": lambda lp, ref: lp - ref,
    "abs": lambda lp, ref: abs(lp - ref),
    "mse": lambda lp, ref: 0.5 * (lp - ref) ** 2,
    "low_var_kl": _k3,
}
VERL_NAMES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


@pytest.mark.parametrize(("name", "estimator"), VERL_NAMES.items())
def test_verl_k_names_are_the_estimators(name, estimator):
    expected = [FORMULAS[estimator](lp, ref) for lp, ref in POINTS]
    assert kl_penalty(LOGPROBS, REF_LOGPROBS, name).tolist() == [pytest.approx(expected, abs=1e-15)]


@pytest.mark.parametrize("base", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_straight_through_has_the_value_of_its_estimator_and_the_gradient_of_k2(base):
    logprobs = LOGPROBS.clone().requires_grad_()
    value = kl_penalty(logprobs, REF_LOGPROBS, f"{base}+")
    formula = FORMULAS[VERL_NAMES.get(base, base)]
    assert value.tolist() == [pytest.approx([formula(lp, ref) for lp, ref in POINTS], abs=1e-15)]
    value.sum().backward()
    # d/dlogp 0.5 (logp - ref)^2 = logp - ref at the three points
    assert logprobs.grad.tolist() == [[0.5, -1.5, 0.0]]


def test_without_the_plus_k1_and_k3_have_their_own_gradients():
    logprobs = LOGPROBS.clone().requires_grad_()
    kl_penalty(logprobs, REF_LOGPROBS, "k3").sum().backward()
    # d/dlogp (e^(ref - logp) - (ref - logp) - 1) = 1 - e^(ref - logp)
    expected = [1 - math.exp(ref - lp) for lp, ref in POINTS]
    assert logprobs.grad.tolist() == [pytest.approx(expected, abs=1e-15)]
    logprobs.grad = None
    kl_penalty(logprobs, REF_LOGPROBS, "k1").sum().backward()
    assert logprobs.grad.tolist() == [[1.0, 1.0, 1.0]]


def test_straight_through_kl_loss_over_a_mask_with_a_gap_and_an_empty_row():
    logprobs = torch.tensor(
        [[-1.0, 5.0, -0.5], [7.0, 7.0, 7.0], [-2.0, -0.25, 3.0]], dtype=torch.float64, requires_grad=True
    )
    ref = torch.tensor([[-1.5, 0.0, -0.5], [0.0, 0.0, 0.0], [-1.0, -0.75, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 0]])
    loss = compute_kl_loss(logprobs, ref, mask, kind="k3+", agg=LossAgg())
    # k3 of the four valid tokens (logp, ref): (-1, -1.5), (-0.5, -0.5), (-2, -1), (-0.25, -0.75)
    k3 = [math.exp(-0.5) + 0.5 - 1, 0.0, math.exp(1.0) - 1.0 - 1, math.exp(-0.5) + 0.5 - 1]
    assert loss.item() == pytest.approx(sum(k3) / 4, rel=1e-12)
    loss.backward()
    # k2's gradient (logp - ref) / 4 on the valid tokens, nothing elsewhere
    assert logprobs.grad.tolist() == [[0.125, 0.0, 0.0], [0.0, 0.0, 0.0], [-0.25, 0.125, 0.0]]


def test_plus_names_put_their_estimators_value_into_the_reward():
    scores = torch.tensor([1.0, 0.0], dtype=torch.float64)
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -0.5], [-0.5, -0.3]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    common = {"scores": scores, "logprobs": logprobs, "ref_logprobs": ref, "response_mask": mask}
    plus, plus_metrics = apply_kl_in_reward(**common, kl_coef=0.1, kind="k3+")
    k3 = [_k3(-1.0, -1.5), _k3(-2.0, -0.5), 0.0]
    assert plus.tolist() == [
        pytest.approx([-0.1 * k3[0], 1.0 - 0.1 * k3[1]], abs=1e-15),
        pytest.approx([0.0, 0.0], abs=1e-15),
    ]
    assert plus_metrics.kl_seq_sum == pytest.approx((k3[0] + k3[1]) / 2, rel=1e-12)
