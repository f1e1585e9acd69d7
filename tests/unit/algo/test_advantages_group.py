"""opo, gpg and grpo_passk against values derived by hand on a batch with a gap, empty rows,
a group of one and an all-empty group."""

import math
import statistics

import pytest
import torch

from rltrain.algo.advantages import AdvantageInputs, compute_advantages

GARBAGE = 37.0  # written into padding; must never reach a result

# Nine responses; the scores (sums over valid tokens) are 1, 1.5, -1, 0, 2, 1, 3, 0, 0.
# Rows 3, 7 and 8 have no valid token; row 1 has a masked token inside it.
MASK = [
    [1, 1, 1, 0],  # 3 tokens
    [1, 0, 1, 1],  # 3 tokens, a gap
    [1, 0, 0, 0],  # 1 token
    [0, 0, 0, 0],  # empty
    [1, 1, 0, 0],  # 2 tokens
    [1, 1, 1, 1],  # 4 tokens
    [1, 1, 0, 0],  # 2 tokens
    [0, 0, 0, 0],  # empty
    [0, 0, 0, 0],  # empty
]
REWARDS = [
    [0.0, 0.0, 1.0, GARBAGE],
    [0.75, GARBAGE, 0.0, 0.75],
    [-1.0, GARBAGE, GARBAGE, GARBAGE],
    [GARBAGE] * 4,
    [0.0, 2.0, GARBAGE, GARBAGE],
    [0.0, 0.0, 0.0, 1.0],
    [0.0, 3.0, GARBAGE, GARBAGE],
    [GARBAGE] * 4,
    [GARBAGE] * 4,
]
SCORES = [1.0, 1.5, -1.0, 0.0, 2.0, 1.0, 3.0, 0.0, 0.0]
LENGTHS = [3, 3, 1, 0, 2, 4, 2, 0, 0]
# Group 5: rows 0-3; group 2: rows 4, 5; row 6 alone (group 9); group 4: two empty rows.
IDS = [5, 5, 5, 5, 2, 2, 9, 4, 4]


def _inputs(ids: list[int] = IDS) -> AdvantageInputs:
    return AdvantageInputs(
        token_level_rewards=torch.tensor(REWARDS, dtype=torch.float64),
        response_mask=torch.tensor(MASK),
        group_ids=torch.tensor(ids),
    )


def _run(name: str, ids: list[int] = IDS, **kwargs):
    out = compute_advantages(name, _inputs(ids), gamma=1.0, lam=1.0, **kwargs)
    assert torch.equal(out.returns, out.advantages)
    return out.advantages


def _expected(per_row: list[float]) -> list[list[float]]:
    """Each row's value on its valid tokens, 0 on the masked ones (empty rows are all 0)."""
    return [[value if keep else 0.0 for keep in m] for value, m in zip(per_row, MASK)]


def _assert_rows(advantages: torch.Tensor, per_row: list[float]) -> None:
    assert advantages.tolist() == [pytest.approx(row, abs=1e-12) for row in _expected(per_row)]


def test_opo_subtracts_the_length_weighted_group_mean():
    b5 = (3 * 1.0 + 3 * 1.5 + 1 * -1.0 + 0 * 0.0) / (3 + 3 + 1 + 0)  # = 13/14; the empty row weighs 0
    b2 = (2 * 2.0 + 4 * 1.0) / (2 + 4)  # = 4/3
    # row 6 is alone: no baseline (verl); group 4 has no valid token: no baseline, and no NaN
    expected = [1.0 - b5, 1.5 - b5, -1.0 - b5, 0.0, 2.0 - b2, 1.0 - b2, 3.0, 0.0, 0.0]
    advantages = _run("opo")
    assert torch.isfinite(advantages).all()
    _assert_rows(advantages, expected)
    assert expected[0] == pytest.approx(1 / 14)  # the plain group mean (0.375) would give 0.625


def test_gpg_scales_the_centred_score_by_batch_over_nonzero_scores():
    alpha = 9 / 6  # nine responses, six nonzero scores
    mean5 = (1.0 + 1.5 - 1.0 + 0.0) / 4  # the empty row counts with its score 0 (verl)
    mean2 = (2.0 + 1.0) / 2
    expected = [
        alpha * (1.0 - mean5),
        alpha * (1.5 - mean5),
        alpha * (-1.0 - mean5),
        0.0,  # its value alpha * (0 - mean5) lands on no token
        alpha * (2.0 - mean2),
        alpha * (1.0 - mean2),
        alpha * 3.0,  # a group of one has mean 0
        0.0,
        0.0,
    ]
    _assert_rows(_run("gpg"), expected)


def test_gpg_with_no_nonzero_score_is_zero():
    inputs = AdvantageInputs(
        token_level_rewards=torch.zeros(4, 3, dtype=torch.float64),
        response_mask=torch.ones(4, 3),
        group_ids=torch.tensor([0, 0, 1, 1]),
    )
    out = compute_advantages("gpg", inputs, gamma=1.0, lam=1.0)
    assert torch.equal(out.advantages, torch.zeros(4, 3, dtype=torch.float64))


PASSK_IDS = [5, 5, 5, 5, 2, 2, 2, 4, 4]  # row 6 joins group 2: grpo_passk needs two per group


def test_grpo_passk_rewards_only_the_best_of_each_group():
    eps = 1e-6
    std5 = math.sqrt(statistics.variance([1.0, 1.5, -1.0, 0.0]))
    std2 = math.sqrt(statistics.variance([2.0, 1.0, 3.0]))  # = 1
    # group 5: best row 1 (1.5), second 1.0; group 2: best row 6 (3), second 2; group 4: 0 - 0
    expected = [0.0, (1.5 - 1.0) / (std5 + eps), 0.0, 0.0, 0.0, 0.0, (3.0 - 2.0) / (std2 + eps), 0.0, 0.0]
    _assert_rows(_run("grpo_passk", PASSK_IDS), expected)
    mean_only = [0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    _assert_rows(_run("grpo_passk", PASSK_IDS, norm_adv_by_std_in_grpo=False), mean_only)


def test_grpo_passk_ties_and_an_empty_winner():
    # group 0: two best of 1 (gap 0); group 1: one best of 3 over a tie of 1 at second place;
    # group 2: the empty row (score 0) beats -1, and its advantage lands on no token
    rewards = [
        [1.0, 0.0],
        [0.0, 1.0],
        [0.0, 0.0],
        [3.0, 0.0],
        [1.0, 0.0],
        [0.0, 1.0],
        [GARBAGE] * 2,
        [-1.0, 0.0],
    ]
    mask = [[1, 1], [1, 1], [1, 1], [1, 1], [1, 1], [1, 1], [0, 0], [1, 1]]
    inputs = AdvantageInputs(
        token_level_rewards=torch.tensor(rewards, dtype=torch.float64),
        response_mask=torch.tensor(mask),
        group_ids=torch.tensor([0, 0, 0, 1, 1, 1, 2, 2]),
    )
    out = compute_advantages("grpo_passk", inputs, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=False)
    expected = [[0.0, 0.0]] * 3 + [[2.0, 2.0]] + [[0.0, 0.0]] * 4
    assert out.advantages.tolist() == expected


def test_grpo_passk_refuses_a_group_of_one():
    with pytest.raises(
        ValueError, match=r"^advantage estimator 'grpo_passk' needs at least 2 .* group id 9 has 1$"
    ):
        _run("grpo_passk", IDS)


@pytest.mark.parametrize("name", ["opo", "gpg", "grpo_passk"])
def test_a_permuted_batch_gives_permuted_advantages(name):
    ids = PASSK_IDS if name == "grpo_passk" else IDS
    order = [8, 3, 6, 0, 5, 2, 7, 1, 4]
    reference = _run(name, ids)
    permuted = AdvantageInputs(
        token_level_rewards=torch.tensor(REWARDS, dtype=torch.float64)[order],
        response_mask=torch.tensor(MASK)[order],
        group_ids=torch.tensor(ids)[order],
    )
    out = compute_advantages(name, permuted, gamma=1.0, lam=1.0)
    assert torch.allclose(out.advantages, reference[order], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["opo", "gpg", "grpo_passk"])
def test_group_estimators_need_group_ids(name):
    no_groups = AdvantageInputs(
        token_level_rewards=torch.tensor(REWARDS, dtype=torch.float64), response_mask=torch.tensor(MASK)
    )
    with pytest.raises(ValueError, match=rf"^advantage estimator '{name}' needs AdvantageInputs.group_ids"):
        compute_advantages(name, no_groups, gamma=1.0, lam=1.0)


def test_scores_in_this_file_are_the_sums_over_valid_tokens():
    sums = [sum(r for r, keep in zip(row, m) if keep) for row, m in zip(REWARDS, MASK)]
    assert sums == SCORES
    assert [sum(m) for m in MASK] == LENGTHS
