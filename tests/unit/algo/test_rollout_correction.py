"""Rollout correction (IS weights, rejection, diagnostics) against values derived by hand."""

import math

import pytest
import torch

from rltrain.algo.loss_agg import LossAgg
from rltrain.algo.losses import PolicyLossInputs, PolicyLossParams, compute_policy_loss, tis_weight
from rltrain.algo.rollout_correction import (
    RejectionBound,
    RolloutCorrectionSpec,
    apply_correction,
    correction_stats,
    is_weights,
    keep_mask,
    parse_rejection,
)

# Three rows; ℓ = log π_old - log μ per token; row 1 has one padding token holding garbage.
LOG_RATIO = [[0.1, 0.2, -0.05], [0.5, 0.6, 9.0], [-0.2, -0.2, -0.2]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -1.0], [-0.3, -0.4, -2.0]], dtype=torch.float64)
OLD = ROLLOUT + torch.tensor(LOG_RATIO, dtype=torch.float64)
MASK64 = MASK.double()


def _ratio(x: float) -> float:
    return math.exp(x)


def _bounds(option: str, spec: str) -> tuple[RejectionBound, ...]:
    return parse_rejection(option, spec)


def _kept_rows(option: str, spec: str) -> list[list[float]]:
    keep = keep_mask((OLD - ROLLOUT), MASK64, _bounds(option, spec)) * MASK64
    return keep.tolist()


def test_sequence_is_is_the_truncated_product_of_the_token_ratios():
    w = is_weights(OLD - ROLLOUT, MASK64, level="sequence", threshold=2.0)
    row0 = math.exp(0.1 + 0.2 - 0.05)  # 1.284..., under the threshold
    row2 = math.exp(-0.6)  # 0.548...
    # row 1: exp(0.5 + 0.6) = 3.004 (the padding's 9.0 is ignored) is truncated to 2.0
    expected = [[row0] * 3, [2.0] * 3, [row2] * 3]
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)


def test_token_is_is_the_existing_tis_weight_bit_for_bit():
    inputs = PolicyLossInputs(
        old_logprobs=OLD.float(),
        logprobs=OLD.float(),
        advantages=torch.ones(3, 3),
        response_mask=MASK,
        rollout_logprobs=ROLLOUT.float(),
    )
    legacy = torch.exp((OLD.float() - ROLLOUT.float()).clamp(max=20.0)).clamp(max=1.5)
    assert torch.equal(tis_weight(inputs, PolicyLossParams(tis_cap=1.5)), legacy)
    w = apply_correction(OLD.float(), ROLLOUT.float(), MASK, RolloutCorrectionSpec("token", 1.5)).weights
    assert torch.equal(w, legacy)


def test_geometric_rejection_bounds_the_per_token_geometric_mean_on_both_sides():
    # geometric means: row 0 exp(0.25/3) = 1.087 (kept), row 1 exp(0.55) = 1.733 (above 1.1),
    # row 2 exp(-0.2) = 0.819 (below 0.9)
    assert _kept_rows("seq_mean_k1", "0.9_1.1") == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]
    # a looser lower bound keeps row 2
    assert _kept_rows("seq_mean_k1", "0.8_1.1") == [[1, 1, 1], [0, 0, 0], [1, 1, 1]]


def test_sequence_rejection_bounds_the_product_of_the_ratios():
    # products: 1.284, 3.004, 0.549
    assert _kept_rows("seq_sum_k1", "0.6_2.0") == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]
    assert _kept_rows("seq_sum_k1", "0.5_3.1") == [[1, 1, 1], [1, 1, 0], [1, 1, 1]]


def test_token_rejection_masks_tokens_outside_lower_and_upper():
    # token ratios: row 0 1.105, 1.221, 0.951; row 1 1.649, 1.822; row 2 0.819 each
    assert _kept_rows("token_k1", "0.85_1.2") == [[1, 0, 1], [0, 0, 0], [0, 0, 0]]
    assert _kept_rows("token_k1", "0.8_1.7") == [[1, 1, 1], [1, 0, 0], [1, 1, 1]]
    # one number u means [1/u, u]: 1/1.25 = 0.8
    assert _bounds("token_k1", "1.25") == (RejectionBound("token_k1", upper=1.25, lower=0.8),)


def test_veto_rejects_a_whole_row_for_its_worst_token():
    # k2 = ℓ²/2 per token; row maxima: 0.02, 0.18, 0.02 -> row 1 vetoed at 0.1
    assert _kept_rows("seq_max_k2", "0.1") == [[1, 1, 1], [0, 0, 0], [1, 1, 1]]
    # k3 = r - 1 - ℓ: token 0.2 of row 0 gives exp(0.2) - 1.2 = 0.0214 > 0.02
    k3 = math.exp(0.2) - 1.2
    assert k3 > 0.02
    assert _kept_rows("token_k3", "0.02") == [[1, 0, 1], [0, 0, 0], [1, 1, 1]]
    # several options must all pass
    assert _kept_rows("seq_max_k2,token_k1", "0.1,0.85_1.2") == [[1, 0, 1], [0, 0, 0], [0, 0, 0]]


def test_identical_logprobs_give_weights_of_exactly_one_and_mask_nothing():
    specs = [
        RolloutCorrectionSpec("token", 2.0, parse_rejection("token_k1,seq_sum_k3", "0.5_2.0,0.01")),
        RolloutCorrectionSpec("sequence", 1.5, parse_rejection("seq_mean_k1,seq_max_k2", "0.999_1.001,1e-6")),
        RolloutCorrectionSpec(
            "token", 1.0, parse_rejection("seq_sum_k1,token_k2,seq_mean_k3", "1.0001,1e-9,1e-9")
        ),
    ]
    logprobs = OLD.float()
    advantages = torch.tensor([[0.5, -1.0, 2.0], [1.0, -0.3, 0.0], [-2.0, 0.1, 0.4]])
    new = logprobs + torch.tensor([[0.3, -0.2, 0.1], [0.0, 0.25, 0.0], [-0.4, 0.05, 0.2]])
    agg = LossAgg("seq-mean-token-mean")
    plain = compute_policy_loss(
        "vanilla",
        PolicyLossInputs(old_logprobs=logprobs, logprobs=new, advantages=advantages, response_mask=MASK),
        params=PolicyLossParams(),
        agg=agg,
    ).loss
    for spec in specs:
        corrected = apply_correction(logprobs, logprobs, MASK, spec)
        assert torch.equal(corrected.weights, torch.ones(3, 3))
        assert torch.equal(corrected.mask, MASK)
        inputs = PolicyLossInputs(
            old_logprobs=logprobs,
            logprobs=new,
            advantages=advantages,
            response_mask=corrected.mask,
            rollout_is_weights=corrected.weights,
        )
        loss = compute_policy_loss("vanilla", inputs, params=PolicyLossParams(), agg=agg).loss
        assert torch.equal(loss, plain)
        metrics = correction_stats(logprobs, logprobs, MASK, spec).metrics(spec)
        assert metrics["rollout_corr/rollout_is_eff_sample_size"] == 1.0
        assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0
        assert metrics["rollout_corr/kl"] == 0.0


def test_diagnostics_match_hand_sums():
    spec = RolloutCorrectionSpec("token", 1.5, parse_rejection("token_k1", "0.85_1.2"))
    m = correction_stats(OLD, ROLLOUT, MASK, spec).metrics(spec)
    tokens = [0.1, 0.2, -0.05, 0.5, 0.6, -0.2, -0.2, -0.2]  # the 8 valid tokens
    n = len(tokens)
    assert m["rollout_corr/kl"] == pytest.approx(-sum(tokens) / n, rel=1e-12)
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(_ratio(x) - 1 - x for x in tokens) / n, rel=1e-12)
    assert m["rollout_corr/chi2_token"] == pytest.approx(
        sum(_ratio(x) ** 2 for x in tokens) / n - 1, rel=1e-12
    )
    w = [min(_ratio(x), 1.5) for x in tokens]  # 1.649 and 1.822 are truncated
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(sum(w) / n, rel=1e-12)
    assert m["rollout_corr/rollout_is_max"] == 1.5
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(math.exp(-0.2), rel=1e-12)
    ess = sum(w) ** 2 / (n * sum(x * x for x in w))
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(ess, rel=1e-12)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(2 / 8)
    # kept tokens (see the token-rejection test): 2 of row 0 only
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(6 / 8)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)


def test_diagnostics_without_weights_describe_the_raw_token_ratios():
    spec = RolloutCorrectionSpec()
    m = correction_stats(OLD, ROLLOUT, MASK, spec).metrics(spec)
    ratios = [_ratio(x) for x in [0.1, 0.2, -0.05, 0.5, 0.6, -0.2, -0.2, -0.2]]
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(0.6), rel=1e-12)
    ess = sum(ratios) ** 2 / (8 * sum(r * r for r in ratios))
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(ess, rel=1e-12)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert "rollout_corr/rollout_is_ratio_fraction_high" not in m


def test_diagnostics_of_parts_merge_to_those_of_the_whole():
    spec = RolloutCorrectionSpec("sequence", 2.0, parse_rejection("seq_mean_k1", "0.9_1.1"))
    whole = correction_stats(OLD, ROLLOUT, MASK, spec)
    parts = correction_stats(OLD[:1], ROLLOUT[:1], MASK[:1], spec).merge(
        correction_stats(OLD[1:], ROLLOUT[1:], MASK[1:], spec)
    )
    torch.testing.assert_close(parts.sums, whole.sums, rtol=1e-14, atol=0)
    assert torch.equal(parts.maxima, whole.maxima)
    assert (whole.kept_tokens, whole.kept_seqs) == (3, 1)


@pytest.mark.parametrize(
    ("rollout_rs", "threshold", "message"),
    [
        ("token_k4", "2.0", "rollout_rs option 'token_k4' is not one of"),
        ("seq_max_k1", "2.0", "rollout_rs option 'seq_max_k1' is not one of"),
        ("token_k1", None, "rollout_rs='token_k1' needs rollout_rs_threshold"),
        ("token_k1", "2.0_0.5", "rollout_rs_threshold of token_k1 needs lower < upper"),
        ("token_k1", "-1_2", "rollout_rs_threshold of token_k1 must be finite and >= 0"),
        ("token_k1", "0", "rollout_rs_threshold of token_k1 must be finite and > 0"),
        ("token_k2", "0.5_2", "rollout_rs_threshold of token_k2 is one upper bound"),
        ("token_k2", "inf", "rollout_rs_threshold of token_k2 must be finite"),
        ("token_k1,token_k2", "1,2,3", "rollout_rs_threshold gives 3 thresholds for 2 rollout_rs options"),
        ("token_k1", "abc", "rollout_rs_threshold 'abc' of token_k1 is not a number"),
    ],
)
def test_bad_rejection_specs_name_the_key(rollout_rs, threshold, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        parse_rejection(rollout_rs, threshold)


def test_a_zero_lower_bound_means_no_lower_bound():
    assert _kept_rows("token_k1", "0_1.2") == [[1, 0, 1], [0, 0, 0], [1, 1, 1]]
