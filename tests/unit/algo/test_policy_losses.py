"""gspo, cispo, geo_mean, clip_cov, kl_cov, gpg/reinforce against values derived by hand.

Every hand batch has three rows of four tokens: row 0 has a gap (tokens 0, 1, 3 valid), row 1 is
empty, row 2 holds two tokens. Padding carries garbage (log-prob -7, log-ratio 3, advantage 9) that
must not leak into a loss, a gradient or a metric.
"""

import math

import pytest
import torch

from rltrain.algo import POLICY_LOSSES
from rltrain.algo.loss_agg import LossAgg
from rltrain.algo.losses import PolicyLossInputs, PolicyLossParams
from tests.unit.algo.hand_batches import grid, run_loss, split_vs_full

MASK = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 0, 0]])
VALID = [(0, 0), (0, 1), (0, 3), (2, 0), (2, 1)]


def _grid(values: list[float], padding: float) -> torch.Tensor:
    return grid(VALID, (3, 4), values, padding)


def _inputs(
    logprobs: list[float], log_ratios: list[float], advantages: list[float], **extra: torch.Tensor
) -> PolicyLossInputs:
    logp = _grid(logprobs, -7.0)
    old = logp - _grid(log_ratios, 3.0)
    return PolicyLossInputs(
        old_logprobs=old,
        logprobs=logp.requires_grad_(),
        advantages=_grid(advantages, 9.0),
        response_mask=MASK,
        **extra,
    )


def _grad_grid(values: list[float]) -> list[list[float]]:
    return [pytest.approx(row, abs=1e-15) for row in _grid(values, 0.0).tolist()]


# -- gspo ------------------------------------------------------------------------------------------


GSPO_LOGPROBS = [-1.0, -2.0, -0.5, -0.2, -3.0]
GSPO_LOG_RATIOS = [0.3, -0.1, 0.4, -0.5, 0.3]
GSPO_ADVANTAGES = [1.0, 1.0, 1.0, -2.0, -1.0]
S2 = math.exp(-0.1)
"""Row 2's sequence ratio: the mean of its log-ratios -0.5, 0.3 is -0.1."""


# Row 0: log-ratios 0.3, -0.1, 0.4 -> s = e^0.2 > 1.2 with A = 1: clipped, -1.2 on each of its 3
# tokens, no gradient. Row 2: s = e^-0.1 in [0.8, 1.2] with A = -2, -1: unclipped, -A·s per token
# (2·S2, S2) with d/dlogp_t = -A_t·S2 (the token ratio's value is s, its gradient s·∇logp_t).
# verl 0.9.1's agg_loss of these, with 5 valid tokens, 2 non-empty rows, response_len 4:
@pytest.mark.parametrize(
    ("mode", "expected_loss", "expected_grads"),
    [
        ("token-mean", (-3.6 + 3 * S2) / 5, [2 * S2 / 5, S2 / 5]),
        ("token-sum", -3.6 + 3 * S2, [2 * S2, S2]),
        ("seq-mean-token-sum", (-3.6 + 3 * S2) / 2, [S2, S2 / 2]),
        ("seq-mean-token-mean", (-3.6 / 3 + 3 * S2 / 2) / 2, [S2 / 2, S2 / 4]),
        ("seq-mean-token-sum-norm", (-3.6 / 4 + 3 * S2 / 4) / 2, [S2 / 4, S2 / 8]),
    ],
)
def test_gspo_clips_the_sequence_ratio_and_aggregates_by_loss_agg_mode(mode, expected_loss, expected_grads):
    inputs = _inputs(GSPO_LOGPROBS, GSPO_LOG_RATIOS, GSPO_ADVANTAGES)
    out, grad = run_loss("gspo", inputs, LossAgg(mode=mode), clip_ratio=0.2)
    assert out.loss.item() == pytest.approx(expected_loss, rel=1e-12)
    assert grad.tolist() == _grad_grid([0.0, 0.0, 0.0, *expected_grads])
    assert out.clipfrac.item() == pytest.approx(3 / 5)
    assert out.clipfrac_lower.item() == 0.0
    assert out.ppo_kl.item() == pytest.approx(-sum(GSPO_LOG_RATIOS) / 5, rel=1e-12)


def test_gspo_follows_loss_agg_mode_token_mean_as_verl_0_9_1():
    # rows of 1 and 3 valid tokens, A = +1 and -1, every ratio 1: per-token losses -1 | 1, 1, 1
    logprobs = torch.tensor([[-1.0, 0.0, 0.0], [-1.0, -2.0, -0.5]], dtype=torch.float64)
    inputs = PolicyLossInputs(
        old_logprobs=logprobs.clone(),
        logprobs=logprobs.clone().requires_grad_(),
        advantages=torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64),
        response_mask=torch.tensor([[1, 0, 0], [1, 1, 1]]),
    )
    out, grad = run_loss("gspo", inputs, LossAgg(mode="token-mean"))
    # token-mean over 4 tokens: (-1 + 3) / 4; d/dlogp_t = -A_t · s / 4 with s = 1
    # (seq-mean-token-mean, verl 0.9.0's, gave 0 and -1/2 | 1/6, 1/6, 1/6)
    assert out.loss.item() == pytest.approx(0.5, rel=1e-12)
    assert grad.tolist() == [
        pytest.approx([-0.25, 0.0, 0.0], abs=1e-15),
        pytest.approx([0.25, 0.25, 0.25], abs=1e-15),
    ]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("token-mean", (-3.6 + 3 * S2) / 50), ("seq-mean-token-mean", (-3.6 / 3 + 3 * S2 / 2) / 4)],
)
def test_gspo_with_global_counts_takes_the_mini_batch_denominators(mode, expected):
    inputs = _inputs(GSPO_LOGPROBS, GSPO_LOG_RATIOS, GSPO_ADVANTAGES)
    out, _ = run_loss("gspo", inputs, LossAgg(mode=mode, global_num_tokens=50, global_num_seqs=4))
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)


# -- cispo -----------------------------------------------------------------------------------------

CISPO_LOGPROBS = [-1.0, -2.0, -0.5, -0.2, -3.0]
CISPO_LOG_RATIOS = [0.3, -0.3, 0.1, 0.0, -0.5]
CISPO_ADVANTAGES = [1.0, -1.0, 2.0, 0.5, 0.5]


def test_cispo_weights_reinforce_by_the_detached_clipped_ratio():
    inputs = _inputs(CISPO_LOGPROBS, CISPO_LOG_RATIOS, CISPO_ADVANTAGES)
    out, grad = run_loss("cispo", inputs, clip_ratio=0.2)
    # weights clip(r, 0.8, 1.2): 1.2 (clipped), 0.8 (clipped), e^0.1, 1, 0.8 (clipped)
    weights = [1.2, 0.8, math.exp(0.1), 1.0, 0.8]
    per_token = [-w * a * lp for w, a, lp in zip(weights, CISPO_ADVANTAGES, CISPO_LOGPROBS)]
    assert per_token == pytest.approx([1.2, -1.6, math.exp(0.1), 0.1, 1.2])
    assert out.loss.item() == pytest.approx(sum(per_token) / 5, rel=1e-12)
    # the weight is a constant: d/dlogp = -w·A / 5
    assert grad.tolist() == _grad_grid([-0.24, 0.16, -2 * math.exp(0.1) / 5, -0.1, -0.08])
    assert out.clipfrac.item() == pytest.approx(3 / 5)
    assert out.clipfrac_lower.item() == 0.0
    assert out.ppo_kl.item() == pytest.approx(-sum(CISPO_LOG_RATIOS) / 5, rel=1e-12)


def test_cispo_with_clip_ratio_low_one_has_no_lower_bound_as_in_the_paper():
    inputs = _inputs(CISPO_LOGPROBS, CISPO_LOG_RATIOS, CISPO_ADVANTAGES)
    out, _ = run_loss("cispo", inputs, clip_ratio=0.2, clip_ratio_low=1.0)
    weights = [1.2, math.exp(-0.3), math.exp(0.1), 1.0, math.exp(-0.5)]
    expected = sum(-w * a * lp for w, a, lp in zip(weights, CISPO_ADVANTAGES, CISPO_LOGPROBS)) / 5
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    assert out.clipfrac.item() == pytest.approx(1 / 5)


# -- geo_mean --------------------------------------------------------------------------------------

GMPO_LOG_RATIOS = [0.5, -0.1, 0.2, -0.6, 0.1]
GMPO_ADVANTAGES = [1.0, 3.0, 2.0, -0.5, -0.5]


def test_geo_mean_clips_token_log_ratios_and_averages_sequences():
    inputs = _inputs([-1.0, -2.0, -0.5, -0.2, -3.0], GMPO_LOG_RATIOS, GMPO_ADVANTAGES)
    out, grad = run_loss("geo_mean", inputs, LossAgg(mode="token-sum"), clip_ratio=0.4)
    # row 0 (A > 0): log-ratios capped above at 0.4 -> 0.4, -0.1, 0.2; ρ = e^(0.5/3); Ā = 2
    # row 2 (A < 0): capped below at -0.4 -> -0.4, 0.1; ρ = e^-0.15; Ā = -0.5
    rho0, rho2 = math.exp(0.5 / 3), math.exp(-0.15)
    assert out.loss.item() == pytest.approx((-2 * rho0 + 0.5 * rho2) / 2, rel=1e-12)
    # d/dlogp_t = -Ā ρ / (tokens · 2 sequences) where the log-ratio is not clipped
    assert grad.tolist() == _grad_grid([0.0, -rho0 / 3, -rho0 / 3, 0.0, rho2 / 8])
    assert out.clipfrac.item() == pytest.approx(1 / 5)  # token (0, 0): A > 0, above 0.4
    assert out.clipfrac_lower.item() == pytest.approx(1 / 5)  # token (2, 0): A < 0, below -0.4
    assert out.ppo_kl.item() == pytest.approx(-sum(GMPO_LOG_RATIOS) / 5, rel=1e-12)


def test_geo_mean_weights_each_sequence_by_the_geometric_mean_of_its_is_weights():
    weights = _grid([0.5, 2.0, 1.0, 1.5, 1.5], 0.0)
    inputs = _inputs(
        [-1.0, -2.0, -0.5, -0.2, -3.0], GMPO_LOG_RATIOS, GMPO_ADVANTAGES, rollout_is_weights=weights
    )
    out, _ = run_loss("geo_mean", inputs, clip_ratio=0.4)
    # (0.5 · 2 · 1)^(1/3) = 1 for row 0, 1.5 for row 2
    expected = (-2 * math.exp(0.5 / 3) + 1.5 * 0.5 * math.exp(-0.15)) / 2
    assert out.loss.item() == pytest.approx(expected, rel=1e-8)
    assert out.tis_weight_mean.item() == pytest.approx(6.5 / 5)


# -- clip_cov --------------------------------------------------------------------------------------

# advantages 2, 2, 2, -2, -2 (mean 0.4); log-probs -0.5, -0.6, -3, -2, -1.9 (mean -1.6)
# covariances (A - 0.4)(logp + 1.6): 1.76, 1.6, -2.24, 0.96, 0.72
COV_LOGPROBS = [-0.5, -0.6, -3.0, -2.0, -1.9]
COV_ADVANTAGES = [2.0, 2.0, 2.0, -2.0, -2.0]


def test_clip_cov_cuts_the_unclipped_token_whose_covariance_lies_in_the_bounds():
    # token (0, 1) has covariance 1.6 in (1, 5) too, but its ratio e^0.5 is clipped already
    inputs = _inputs(COV_LOGPROBS, [0.0, 0.5, 0.0, 0.0, 0.0], COV_ADVANTAGES)
    out, grad = run_loss("clip_cov", inputs, clip_ratio=0.2)
    # per token: cut 0, clipped -2·1.2, -2, 2, 2; one token cut (max(⌊0.0002·5⌋, 1))
    assert out.loss.item() == pytest.approx((0 - 2.4 - 2 + 2 + 2) / 5, rel=1e-12)
    assert grad.tolist() == _grad_grid([0.0, 0.0, -0.4, 0.4, 0.4])
    assert out.clipfrac.item() == pytest.approx(1 / 5)
    assert out.clipfrac_lower.item() == 0.0
    assert out.ppo_kl.item() == pytest.approx(-0.5 / 5, rel=1e-12)


def test_clip_cov_without_candidates_is_the_clipped_surrogate():
    inputs = _inputs(COV_LOGPROBS, [0.0, 0.5, 0.0, 0.0, 0.0], COV_ADVANTAGES)
    out, grad = run_loss("clip_cov", inputs, clip_ratio=0.2, clip_cov_lb=2.0)
    assert out.loss.item() == pytest.approx((-2 - 2.4 - 2 + 2 + 2) / 5, rel=1e-12)
    assert grad.tolist() == _grad_grid([-0.4, 0.0, -0.4, 0.4, 0.4])
    assert out.clipfrac.item() == 0.0


def test_clip_cov_draws_the_cut_tokens_among_the_candidates():
    # bounds (0.5, 5): candidates (0, 0), (2, 0), (2, 1); ⌊0.4 · 5⌋ = 2 of them are cut
    cuts = set()
    for seed in range(8):
        torch.manual_seed(seed)
        inputs = _inputs(COV_LOGPROBS, [0.0, 0.5, 0.0, 0.0, 0.0], COV_ADVANTAGES)
        out, grad = run_loss("clip_cov", inputs, clip_ratio=0.2, clip_cov_lb=0.5, clip_cov_ratio=0.4)
        cut = {(r, c) for r, c in VALID if grad[r, c] == 0.0} - {(0, 1)}  # (0, 1) is clipped
        assert len(cut) == 2 and cut <= {(0, 0), (2, 0), (2, 1)}
        (kept,) = {(0, 0), (2, 0), (2, 1)} - cut
        assert out.loss.item() == pytest.approx((-2.4 - 2 + {(0, 0): -2, (2, 0): 2, (2, 1): 2}[kept]) / 5)
        assert out.clipfrac.item() == pytest.approx(2 / 5)
        cuts.add(frozenset(cut))
    assert len(cuts) > 1  # the draw is random (seeded)


# -- kl_cov ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kl_cov_ratio", "num_penalized"), [(0.0002, 1), (0.4, 2)])
def test_kl_cov_penalizes_the_tokens_of_largest_covariance(kl_cov_ratio, num_penalized):
    inputs = _inputs(COV_LOGPROBS, [-0.2, 0.5, 0.0, 0.0, 0.0], COV_ADVANTAGES)
    out, grad = run_loss("kl_cov", inputs, clip_ratio=0.2, kl_cov_ratio=kl_cov_ratio, ppo_kl_coef=0.1)
    # no clipping: -A·r everywhere; + 0.1·|lr| on (0, 0) (covariance 1.76), then (0, 1) (1.6)
    per_token = [-2 * math.exp(-0.2) + 0.1 * 0.2, -2 * math.exp(0.5), -2.0, 2.0, 2.0]
    grads = [(-2 * math.exp(-0.2) - 0.1) / 5, -2 * math.exp(0.5) / 5, -0.4, 0.4, 0.4]
    if num_penalized == 2:
        per_token[1] += 0.1 * 0.5
        grads[1] += 0.1 / 5
    assert out.loss.item() == pytest.approx(sum(per_token) / 5, rel=1e-12)
    assert grad.tolist() == _grad_grid(grads)
    assert out.clipfrac.item() == pytest.approx(num_penalized / 5)
    assert out.ppo_kl.item() == pytest.approx(-(-0.2 + 0.5) / 5, rel=1e-12)


# -- gpg / reinforce -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpg", "reinforce"])
@pytest.mark.parametrize(
    ("mode", "expected"),
    [("token-mean", 1.6 / 5), ("token-sum", 1.6), ("seq-mean-token-mean", ((1 - 2 + 1) / 3 + 1.6 / 2) / 2)],
)
def test_policy_gradient_is_minus_advantage_times_logprob(name, mode, expected):
    # per token -A·logp: 1, -2, 1, 0.1, 1.5
    inputs = _inputs(CISPO_LOGPROBS, CISPO_LOG_RATIOS, CISPO_ADVANTAGES)
    out, grad = run_loss(name, inputs, LossAgg(mode=mode))
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    assert out.clipfrac.item() == 0.0 and out.clipfrac_lower.item() == 0.0
    assert out.ppo_kl.item() == pytest.approx(-sum(CISPO_LOG_RATIOS) / 5, rel=1e-12)
    if mode == "token-mean":
        assert grad.tolist() == _grad_grid([-0.2, 0.2, -0.4, -0.1, -0.1])


def test_reinforce_is_verl_gpg_under_a_second_name():
    assert POLICY_LOSSES.get("reinforce") is POLICY_LOSSES.get("gpg")


def test_policy_gradient_with_rollout_is_weights():
    weights = _grid([0.5, 2.0, 1.0, 1.0, 0.5], 0.0)
    inputs = _inputs(CISPO_LOGPROBS, CISPO_LOG_RATIOS, CISPO_ADVANTAGES, rollout_is_weights=weights)
    out, _ = run_loss("gpg", inputs)
    assert out.loss.item() == pytest.approx((0.5 - 4 + 1 + 0.1 + 0.75) / 5, rel=1e-12)
    assert out.tis_weight_mean.item() == pytest.approx(1.0)


def test_unknown_policy_loss_names_the_closest():
    with pytest.raises(KeyError, match="did you mean 'gspo'"):
        POLICY_LOSSES.get("gpso")


# -- split invariance ------------------------------------------------------------------------------

MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _split_vs_full(name: str, mode: str, **params: float):
    return split_vs_full(name, mode, PolicyLossParams(**params), seed=3)


@pytest.mark.parametrize("name", ["gspo", "cispo", "geo_mean", "gpg", "reinforce"])
@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_losses_with_global_counts_sum_to_the_full_batch(name, mode):
    full, full_grad, parts = _split_vs_full(name, mode, clip_ratio=0.2, clip_ratio_high=0.28)
    assert sum(p.loss.item() for p, _ in parts) == pytest.approx(full.loss.item(), abs=1e-12)
    torch.testing.assert_close(torch.cat([g for _, g in parts]), full_grad, rtol=0, atol=1e-12)
    for metric in ("clipfrac", "clipfrac_lower", "ppo_kl"):
        total = sum(getattr(p, metric).item() for p, _ in parts)
        assert total == pytest.approx(getattr(full, metric).item(), abs=1e-12)
    assert abs(full.loss.item()) > 1e-3


def test_covariance_losses_select_by_micro_batch_as_verl_does():
    # kl_cov penalizes max(⌊ratio · N⌋, 1) tokens of each micro-batch: one in the full batch, one
    # in each of the three micro-batches (14 valid tokens in all)
    full, _, parts = _split_vs_full("kl_cov", "token-mean")
    assert full.clipfrac.item() == pytest.approx(1 / 14)
    assert sum(p.clipfrac.item() for p, _ in parts) == pytest.approx(3 / 14)
    # with nothing to select they are split invariant: no KL weight, no covariance in the bounds
    for name, params in (
        ("kl_cov", {"ppo_kl_coef": 0.0}),
        ("clip_cov", {"clip_cov_lb": 100.0, "clip_cov_ub": 200.0}),
    ):
        full, full_grad, parts = _split_vs_full(name, "seq-mean-token-mean", **params)
        assert sum(p.loss.item() for p, _ in parts) == pytest.approx(full.loss.item(), abs=1e-12)
        torch.testing.assert_close(torch.cat([g for _, g in parts]), full_grad, rtol=0, atol=1e-12)
