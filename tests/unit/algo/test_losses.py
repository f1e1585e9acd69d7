"""Loss aggregation, PPO policy loss, value loss, entropy and KL loss against hand formulas."""

import math

import pytest
import torch

from rltrain.algo.kl import kl_penalty
from rltrain.algo.loss_agg import LossAgg, agg_loss
from rltrain.algo.losses import (
    PolicyLossInputs,
    PolicyLossParams,
    compute_entropy_loss,
    compute_kl_loss,
    compute_policy_loss,
    compute_value_loss,
)

MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

# Eight responses of lengths 5, 2, 3, 1, 0 (fully masked), 4, 2, 5 with garbage in the padding.
LENGTHS = [5, 2, 3, 1, 0, 4, 2, 5]
T = 5
LOSS_ROWS = [
    [round(0.37 * (i + 1) - 0.21 * t * (i % 3) + 0.05 * t * t, 4) for t in range(T)] for i in range(8)
]
LOSS_MAT = torch.tensor(LOSS_ROWS, dtype=torch.float64)
AGG_MASK = torch.tensor([[1] * n + [0] * (T - n) for n in LENGTHS])
LOSS_MAT[AGG_MASK == 0] = 1e3


def _hand_agg(mode: str, scale: float = T) -> float:
    rows = [row[:n] for row, n in zip(LOSS_ROWS, LENGTHS) if n > 0]
    num_seqs = len(rows)
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "token-sum":
        return sum(sum(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / num_seqs
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / num_seqs
    assert mode == "seq-mean-token-sum-norm"
    return sum(sum(r) / scale for r in rows) / num_seqs


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_local_counts_match_hand_formula(mode):
    assert agg_loss(LOSS_MAT, AGG_MASK, mode).item() == pytest.approx(_hand_agg(mode), rel=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_micro_batches", [1, 2, 4])
def test_agg_loss_micro_batches_sum_to_full_batch(mode, num_micro_batches):
    global_num_tokens = int(AGG_MASK.sum())
    global_num_seqs = int((AGG_MASK.sum(-1) > 0).sum())
    total = sum(
        agg_loss(
            loss_chunk,
            mask_chunk,
            mode,
            global_num_tokens=global_num_tokens,
            global_num_seqs=global_num_seqs,
            loss_scale_factor=7.0,
        )
        for loss_chunk, mask_chunk in zip(
            LOSS_MAT.chunk(num_micro_batches), AGG_MASK.chunk(num_micro_batches)
        )
    )
    full = agg_loss(LOSS_MAT, AGG_MASK, mode, loss_scale_factor=7.0)
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    assert total.item() == pytest.approx(_hand_agg(mode, scale=7.0), abs=1e-6)


def test_local_denominators_are_not_split_invariant():
    # Why the global denominators exist: averaging per-micro-batch token means is biased.
    # The quarters hold 7, 4, 4 and 7 valid tokens.
    quarters = [agg_loss(x, m, "token-mean") for x, m in zip(LOSS_MAT.chunk(4), AGG_MASK.chunk(4))]
    assert abs(sum(quarters).item() / 4 - _hand_agg("token-mean")) > 1e-3


def test_unknown_agg_mode():
    with pytest.raises(KeyError, match="did you mean 'token-mean'"):
        LossAgg(mode="token_mean")


def _policy_inputs(
    ratios: list[float], advantages: list[float], **extra: torch.Tensor
) -> tuple[PolicyLossInputs, torch.Tensor]:
    old = torch.tensor([[-1.0 - 0.1 * i for i in range(len(ratios))]], dtype=torch.float64)
    logprobs = (old + torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64)).requires_grad_()
    inputs = PolicyLossInputs(
        old_logprobs=old,
        logprobs=logprobs,
        advantages=torch.tensor([advantages], dtype=torch.float64),
        response_mask=torch.ones(1, len(ratios), dtype=torch.int64),
        **extra,
    )
    return inputs, logprobs


def _vanilla(inputs: PolicyLossInputs, agg: LossAgg | None = None, **params: float):
    return compute_policy_loss("vanilla", inputs, params=PolicyLossParams(**params), agg=agg or LossAgg())


def test_identical_policies_give_ratio_one():
    advantages = torch.tensor([[0.5, -1.0, 2.0, 9.0], [-0.25, 0.75, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    old = torch.tensor([[-1.0, -0.3, -2.2, -5.0], [-0.7, -1.1, -3.0, -4.0]], dtype=torch.float64)
    logprobs = old.clone().requires_grad_()
    out = _vanilla(PolicyLossInputs(old, logprobs, advantages, mask))
    valid_adv = [0.5, -1.0, 2.0, -0.25, 0.75]
    assert out.loss.item() == pytest.approx(-sum(valid_adv) / 5, abs=1e-15)
    assert out.clipfrac.item() == 0.0
    assert out.clipfrac_lower.item() == 0.0
    assert out.ppo_kl.item() == 0.0
    assert out.tis_weight_mean is None
    out.loss.backward()
    # d(-A·r)/dlogp = -A·r = -A at r = 1, divided by the 5 valid tokens
    assert logprobs.grad.tolist() == [
        pytest.approx([-0.5 / 5, 1.0 / 5, -2.0 / 5, 0.0]),
        pytest.approx([0.25 / 5, -0.75 / 5, 0.0, 0.0]),
    ]


@pytest.mark.parametrize(
    ("ratio", "advantage", "expected_loss", "clipped"),
    [
        (1.5, 1.0, -1.2, 1.0),  # A > 0, ratio above 1 + ε: clipped to 1.2
        (0.5, 1.0, -0.5, 0.0),  # A > 0, ratio below 1 - ε: the unclipped term is the max
        (0.5, -1.0, 0.8, 1.0),  # A < 0, ratio below 1 - ε: clipped to 0.8
        (1.5, -1.0, 1.5, 0.0),  # A < 0, ratio above 1 + ε: unclipped, below the dual bound 3
    ],
)
def test_clipped_surrogate_hand_cases(ratio, advantage, expected_loss, clipped):
    inputs, _ = _policy_inputs([ratio], [advantage])
    out = _vanilla(inputs, clip_ratio=0.2)
    assert out.loss.item() == pytest.approx(expected_loss, rel=1e-12)
    assert out.clipfrac.item() == clipped
    assert out.clipfrac_lower.item() == 0.0
    assert out.ppo_kl.item() == pytest.approx(-math.log(ratio), rel=1e-12)


def test_asymmetric_clip_ratios():
    inputs, _ = _policy_inputs([1.5, 0.5], [1.0, -1.0])
    out = _vanilla(inputs, clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.28)
    assert out.loss.item() == pytest.approx((-1.28 + 0.9) / 2, rel=1e-12)


def test_dual_clip_bounds_negative_advantage_loss():
    ratios = [math.exp(5.0), math.exp(30.0), 1.5, 0.5, 1.0]
    advantages = [-0.5, -2.0, -1.0, 1.0, 4.0]
    inputs, logprobs = _policy_inputs(ratios, advantages)
    out = _vanilla(inputs, clip_ratio=0.2, clip_ratio_c=3.0)
    # per token: 3·0.5 (bound attained), 3·2 (bound attained; log-ratio 30 clamped to 20), 1.5, -0.5, -4
    per_token = [1.5, 6.0, 1.5, -0.5, -4.0]
    assert out.loss.item() == pytest.approx(sum(per_token) / 5, rel=1e-12)
    assert math.isfinite(out.loss.item())
    assert out.clipfrac_lower.item() == pytest.approx(2 / 5)
    assert out.clipfrac.item() == 0.0
    assert out.ppo_kl.item() == pytest.approx(-(5.0 + 20.0 + math.log(1.5) + math.log(0.5)) / 5, rel=1e-12)
    out.loss.backward()
    # the bounded tokens are constant in logprobs: no gradient through them
    assert logprobs.grad[0, :2].tolist() == [0.0, 0.0]


def test_dual_clip_bound_for_each_token_with_a_large_ratio():
    advantages = [-0.1, -1.0, -3.0]
    inputs, _ = _policy_inputs([50.0] * 3, advantages)
    for index, advantage in enumerate(advantages):
        single = PolicyLossInputs(
            old_logprobs=inputs.old_logprobs[:, index : index + 1],
            logprobs=inputs.logprobs[:, index : index + 1],
            advantages=inputs.advantages[:, index : index + 1],
            response_mask=inputs.response_mask[:, index : index + 1],
        )
        loss = _vanilla(single, clip_ratio_c=2.5).loss.item()
        assert loss == pytest.approx(2.5 * abs(advantage), rel=1e-12)


def test_clip_ratio_c_must_exceed_one():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        PolicyLossParams(clip_ratio_c=1.0)


def test_truncated_importance_sampling_weight():
    rollout = torch.tensor([[-1.5, -1.2, -0.4]], dtype=torch.float64)
    inputs, logprobs = _policy_inputs([1.0, 1.0, 1.0], [1.0, -2.0, 0.5], rollout_logprobs=rollout)
    old = inputs.old_logprobs[0].tolist()  # -1.0, -1.1, -1.2
    cap = 1.5
    weights = [min(math.exp(o - r), cap) for o, r in zip(old, rollout[0].tolist())]
    assert weights == pytest.approx([1.5, math.exp(0.1), math.exp(-0.8)])  # first one capped
    out = _vanilla(inputs, tis_cap=cap)
    assert out.loss.item() == pytest.approx(-(1.0 * weights[0] - 2.0 * weights[1] + 0.5 * weights[2]) / 3)
    assert out.tis_weight_mean.item() == pytest.approx(sum(weights) / 3)
    out.loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx(
        [-1.0 * weights[0] / 3, 2.0 * weights[1] / 3, -0.5 * weights[2] / 3]
    )


def test_rollout_logprobs_without_cap_leave_the_loss_alone():
    rollout = torch.tensor([[-3.0]], dtype=torch.float64)
    inputs, _ = _policy_inputs([1.0], [2.0], rollout_logprobs=rollout)
    out = _vanilla(inputs)
    assert out.loss.item() == -2.0
    assert out.tis_weight_mean is None


def test_tis_cap_needs_rollout_logprobs():
    inputs, _ = _policy_inputs([1.0], [1.0])
    with pytest.raises(ValueError, match="rollout_logprobs is None"):
        _vanilla(inputs, tis_cap=2.0)


def test_policy_metrics_with_global_token_count_sum_over_micro_batches():
    ratios = [1.5, 0.5, 1.0, 1.5]
    advantages = [1.0, -1.0, 2.0, -1.0]
    inputs, _ = _policy_inputs(ratios, advantages)
    full = _vanilla(inputs, agg=LossAgg(global_num_tokens=4))
    parts = []
    for cols in (slice(0, 1), slice(1, 4)):
        part = PolicyLossInputs(
            old_logprobs=inputs.old_logprobs[:, cols],
            logprobs=inputs.logprobs[:, cols],
            advantages=inputs.advantages[:, cols],
            response_mask=inputs.response_mask[:, cols],
        )
        parts.append(_vanilla(part, agg=LossAgg(global_num_tokens=4)))
    assert full.clipfrac.item() == pytest.approx(2 / 4)
    assert sum(p.clipfrac.item() for p in parts) == pytest.approx(full.clipfrac.item())
    assert sum(p.loss.item() for p in parts) == pytest.approx(full.loss.item())
    assert sum(p.ppo_kl.item() for p in parts) == pytest.approx(full.ppo_kl.item())


def test_value_loss_hand_example():
    vpreds = torch.tensor([[1.0, 2.0, 2.0, 5.0]], dtype=torch.float64, requires_grad=True)
    values = torch.tensor([[0.8, 0.5, 0.5, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 0.0, 3.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    out = compute_value_loss(
        vpreds=vpreds, values=values, returns=returns, response_mask=mask, cliprange_value=0.5, agg=LossAgg()
    )
    # token 0: inside the clip range, (1-2)^2 = 1; token 1: clipped 1.0 gives 1 < unclipped 4 -> 4;
    # token 2: clipped 1.0 gives (1-3)^2 = 4 > unclipped 1 -> 4 (clipped); token 3 masked
    assert out.loss.item() == pytest.approx(0.5 * (1.0 + 4.0 + 4.0) / 3)
    assert out.vf_clipfrac.item() == pytest.approx(1 / 3)
    out.loss.backward()
    # gradient 0.5·2(v - R)/3 where the unclipped error is used, 0 where the clipped one is
    assert vpreds.grad.tolist() == [pytest.approx([-1.0 / 3, 2.0 / 3, 0.0, 0.0])]


@pytest.mark.parametrize("mode", MODES)
def test_entropy_loss_is_aggregated_entropy(mode):
    agg = LossAgg(mode=mode)
    assert compute_entropy_loss(LOSS_MAT, AGG_MASK, agg).item() == pytest.approx(_hand_agg(mode), rel=1e-12)


def test_kl_loss_hand_value():
    logprobs = torch.tensor([[-1.0, -2.0, -7.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -0.5, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    k3 = [math.exp(-0.5) + 0.5 - 1.0, math.exp(1.5) - 1.5 - 1.0]
    loss = compute_kl_loss(logprobs, ref, mask, kind="low_var_kl", agg=LossAgg())
    assert loss.item() == pytest.approx(sum(k3) / 2, rel=1e-12)
    seq_sum = compute_kl_loss(logprobs, ref, mask, kind="kl", agg=LossAgg(mode="seq-mean-token-sum"))
    assert seq_sum.item() == pytest.approx(0.5 - 1.5)
    assert torch.equal(
        kl_penalty(logprobs, ref, "kl")[:, :2], torch.tensor([[0.5, -1.5]], dtype=torch.float64)
    )


def test_token_sum_divides_by_nothing():
    loss_mat = torch.tensor([[1.5, -0.5, 9.0], [9.0, 9.0, 9.0], [2.0, 9.0, 0.25]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    loss = agg_loss(loss_mat, mask, "token-sum", global_num_tokens=100, global_num_seqs=100)
    assert loss.item() == 1.5 - 0.5 + 2.0 + 0.25
    loss.backward()
    assert loss_mat.grad.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]]
