"""Advantage estimators against plain-Python references and hand-derived values."""

import math
import statistics

import pytest
import torch

from rltrain.algo.advantages import AdvantageInputs, compute_advantages

GARBAGE = 37.0  # written into padding; must never reach a result


def _tensor(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _mask(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def _whiten_reference(valid: list[float]) -> list[float]:
    mean = statistics.fmean(valid)
    std = math.sqrt(statistics.variance(valid) + 1e-8)
    return [(v - mean) / std for v in valid]


def _gae_reference(
    rewards: list[list[float]], values: list[list[float]], mask: list[list[int]], gamma: float, lam: float
) -> tuple[list[list[float]], list[list[float]]]:
    """Raw (un-whitened) advantages and returns, recursing over each row's valid positions only."""
    all_adv, all_ret = [], []
    for r, v, m in zip(rewards, values, mask):
        positions = [t for t, keep in enumerate(m) if keep]
        adv = [0.0] * len(r)
        ret = [0.0] * len(r)
        next_value, next_adv = 0.0, 0.0
        for t in reversed(positions):
            delta = r[t] + gamma * next_value - v[t]
            next_adv = delta + gamma * lam * next_adv
            next_value = v[t]
            adv[t] = next_adv
            ret[t] = next_adv + v[t]
        all_adv.append(adv)
        all_ret.append(ret)
    return all_adv, all_ret


def _valid(rows: list[list[float]], mask: list[list[int]]) -> list[float]:
    return [x for row, m in zip(rows, mask) for x, keep in zip(row, m) if keep]


def _unflatten(flat: list[float], mask: list[list[int]]) -> list[list[float]]:
    it = iter(flat)
    return [[next(it) if keep else 0.0 for keep in m] for m in mask]


# Four responses of lengths 5, 3, 1 and 4 (tail padded), plus garbage in the padding.
GAE_MASK = [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]]
GAE_REWARDS = [
    [0.1, -0.2, 0.0, 0.3, 1.0],
    [0.0, 0.5, -1.0, GARBAGE, GARBAGE],
    [2.0, GARBAGE, GARBAGE, GARBAGE, GARBAGE],
    [-0.3, 0.0, 0.2, 0.7, GARBAGE],
]
GAE_VALUES = [
    [0.5, 0.4, 0.3, 0.2, 0.1],
    [-0.1, 0.2, 0.6, GARBAGE, GARBAGE],
    [1.5, GARBAGE, GARBAGE, GARBAGE, GARBAGE],
    [0.0, -0.4, 0.8, 0.25, GARBAGE],
]


def _gae(gamma: float, lam: float, mask: list[list[int]] = GAE_MASK):
    inputs = AdvantageInputs(
        token_level_rewards=_tensor(GAE_REWARDS), response_mask=_mask(mask), values=_tensor(GAE_VALUES)
    )
    return compute_advantages("gae", inputs, gamma=gamma, lam=lam)


@pytest.mark.parametrize(("gamma", "lam"), [(0.9, 0.8), (1.0, 0.95), (0.99, 1.0)])
def test_gae_matches_per_step_recursion(gamma, lam):
    raw_adv, returns = _gae_reference(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma, lam)
    out = _gae(gamma, lam)
    assert out.returns.tolist() == [pytest.approx(row, abs=1e-12) for row in returns]
    expected = _unflatten(_whiten_reference(_valid(raw_adv, GAE_MASK)), GAE_MASK)
    assert out.advantages.tolist() == [pytest.approx(row, abs=1e-12) for row in expected]


def test_gae_with_gamma_lam_one_is_reward_to_go_minus_value():
    out = _gae(1.0, 1.0)
    raw = []
    for row, (r, v, m) in enumerate(zip(GAE_REWARDS, GAE_VALUES, GAE_MASK)):
        n = sum(m)
        reward_to_go = [sum(r[t:n]) for t in range(n)]
        # returns = raw advantages + values = reward-to-go
        assert out.returns[row].tolist() == pytest.approx(reward_to_go + [0.0] * (len(m) - n), abs=1e-12)
        raw.extend(g - v[t] for t, g in enumerate(reward_to_go))
    # the advantages are the whitened raw advantages (reward-to-go minus value)
    assert _valid(out.advantages.tolist(), GAE_MASK) == pytest.approx(_whiten_reference(raw), abs=1e-12)


def test_gae_skips_interior_masked_tokens():
    mask = [[1, 0, 1, 1, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]]
    raw_adv, returns = _gae_reference(GAE_REWARDS, GAE_VALUES, mask, 0.9, 0.8)
    out = _gae(0.9, 0.8, mask)
    assert out.returns.tolist() == [pytest.approx(row, abs=1e-12) for row in returns]
    expected = _unflatten(_whiten_reference(_valid(raw_adv, mask)), mask)
    assert out.advantages.tolist() == [pytest.approx(row, abs=1e-12) for row in expected]


def test_gae_ignores_non_finite_padding():
    rewards = _tensor(GAE_REWARDS)
    values = _tensor(GAE_VALUES)
    pad = ~_mask(GAE_MASK).bool()
    values[pad] = float("nan")
    rewards[pad] = float("inf")
    inputs = AdvantageInputs(token_level_rewards=rewards, response_mask=_mask(GAE_MASK), values=values)
    out = compute_advantages("gae", inputs, gamma=0.9, lam=0.8)
    reference = _gae(0.9, 0.8)
    assert torch.equal(out.advantages, reference.advantages)
    assert torch.equal(out.returns, reference.returns)


# Two groups (ids 7 and 3, interleaved) with scores 1, 0, 0.5 and 2, 4; rows of different lengths.
GROUP_IDS = torch.tensor([7, 3, 7, 3, 7])
GROUP_MASK = [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]
GROUP_REWARDS = [
    [0.5, 0.0, 0.5, GARBAGE],  # score 1.0 (rewards on two tokens)
    [2.0, GARBAGE, GARBAGE, GARBAGE],  # score 2.0
    [0.0, 0.0, 0.0, 0.0],  # score 0.0
    [0.0, 4.0, GARBAGE, GARBAGE],  # score 4.0
    [0.0, 0.0, 0.5, GARBAGE],  # score 0.5
]


def _group_inputs(group_ids: torch.Tensor = GROUP_IDS) -> AdvantageInputs:
    return AdvantageInputs(
        token_level_rewards=_tensor(GROUP_REWARDS), response_mask=_mask(GROUP_MASK), group_ids=group_ids
    )


def _per_sequence(out_tensor: torch.Tensor, mask: list[list[int]]) -> list[float]:
    """The single value each row carries on its valid tokens (asserting it is constant, 0 elsewhere)."""
    values = []
    for row, m in zip(out_tensor.tolist(), mask):
        valid = [x for x, keep in zip(row, m) if keep]
        assert valid == pytest.approx([valid[0]] * len(valid), abs=1e-15)
        assert [x for x, keep in zip(row, m) if not keep] == [0.0] * (len(m) - sum(m))
        values.append(valid[0])
    return values


def test_grpo_hand_values():
    out = compute_advantages("grpo", _group_inputs(), gamma=1.0, lam=1.0)
    eps = 1e-6
    std_a, std_b = 0.5, math.sqrt(2.0)  # unbiased std of (1, 0, 0.5) and (2, 4)
    expected = [0.5 / (std_a + eps), -1.0 / (std_b + eps), -0.5 / (std_a + eps), 1.0 / (std_b + eps), 0.0]
    assert _per_sequence(out.advantages, GROUP_MASK) == pytest.approx(expected, abs=1e-12)
    assert torch.equal(out.returns, out.advantages)


def test_grpo_advantages_have_zero_mean_per_group():
    adv = _per_sequence(
        compute_advantages("grpo", _group_inputs(), gamma=1.0, lam=1.0).advantages, GROUP_MASK
    )
    assert adv[0] + adv[2] + adv[4] == pytest.approx(0.0, abs=1e-12)
    assert adv[1] + adv[3] == pytest.approx(0.0, abs=1e-12)


def test_grpo_mean_only_switch():
    out = compute_advantages("grpo", _group_inputs(), gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=False)
    assert _per_sequence(out.advantages, GROUP_MASK) == pytest.approx([0.5, -1.0, -0.5, 1.0, 0.0], abs=1e-12)


def test_grpo_group_of_one_has_mean_zero_std_one():
    ids = torch.tensor([7, 3, 7, 9, 7])  # row 3 (score 4) is alone; row 1 (score 2) alone in group 3
    out = compute_advantages("grpo", _group_inputs(ids), gamma=1.0, lam=1.0, epsilon=1e-6)
    adv = _per_sequence(out.advantages, GROUP_MASK)
    assert adv[1] == pytest.approx(2.0 / (1.0 + 1e-6), abs=1e-12)
    assert adv[3] == pytest.approx(4.0 / (1.0 + 1e-6), abs=1e-12)
    mean_only = compute_advantages(
        "grpo", _group_inputs(ids), gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=False
    )
    assert _per_sequence(mean_only.advantages, GROUP_MASK)[3] == pytest.approx(4.0)


def test_rloo_hand_values():
    out = compute_advantages("rloo", _group_inputs(), gamma=1.0, lam=1.0)
    # score minus the mean of the other scores of its group
    expected = [1.0 - (0.0 + 0.5) / 2, 2.0 - 4.0, 0.0 - (1.0 + 0.5) / 2, 4.0 - 2.0, 0.5 - (1.0 + 0.0) / 2]
    assert _per_sequence(out.advantages, GROUP_MASK) == pytest.approx(expected, abs=1e-12)


def test_rloo_group_of_one_keeps_its_score():
    out = compute_advantages("rloo", _group_inputs(torch.tensor([7, 3, 7, 9, 7])), gamma=1.0, lam=1.0)
    adv = _per_sequence(out.advantages, GROUP_MASK)
    assert adv[1] == pytest.approx(2.0)
    assert adv[3] == pytest.approx(4.0)


def test_reinforce_plus_plus_hand_values():
    mask = [[1, 1, 1, 0], [1, 1, 0, 0]]
    rewards = [[1.0, 0.0, 2.0, GARBAGE], [0.0, -1.0, GARBAGE, GARBAGE]]
    inputs = AdvantageInputs(token_level_rewards=_tensor(rewards), response_mask=_mask(mask))
    out = compute_advantages("reinforce_plus_plus", inputs, gamma=0.5, lam=1.0)
    # reward-to-go with γ = 0.5: row 0: 1 + 0.5·(0 + 0.5·2) = 1.5, 0 + 0.5·2 = 1, 2; row 1: -0.5, -1
    assert out.returns.tolist() == [[1.5, 1.0, 2.0, 0.0], [-0.5, -1.0, 0.0, 0.0]]
    expected = _unflatten(_whiten_reference([1.5, 1.0, 2.0, -0.5, -1.0]), mask)
    assert out.advantages.tolist() == [pytest.approx(row, abs=1e-12) for row in expected]


def test_reinforce_plus_plus_skips_interior_masked_tokens():
    mask = [[1, 0, 1, 1], [1, 1, 0, 0]]
    rewards = [[0.0, GARBAGE, 1.0, 2.0], [0.0, -1.0, GARBAGE, GARBAGE]]
    inputs = AdvantageInputs(token_level_rewards=_tensor(rewards), response_mask=_mask(mask))
    out = compute_advantages("reinforce_plus_plus", inputs, gamma=0.5, lam=1.0)
    # row 0 over its valid positions 0, 2, 3: 2; 1 + 0.5·2 = 2; 0 + 0.5·2 = 1
    assert out.returns.tolist() == [[1.0, 0.0, 2.0, 2.0], [-0.5, -1.0, 0.0, 0.0]]


def test_reinforce_plus_plus_baseline_hand_values():
    out = compute_advantages("reinforce_plus_plus_baseline", _group_inputs(), gamma=1.0, lam=1.0)
    centered = [1.0 - 0.5, 2.0 - 3.0, 0.0 - 0.5, 4.0 - 3.0, 0.5 - 0.5]  # score minus group mean
    tokens = [c for c, m in zip(centered, GROUP_MASK) for _ in range(sum(m))]
    expected = _unflatten(_whiten_reference(tokens), GROUP_MASK)
    assert out.advantages.tolist() == [pytest.approx(row, abs=1e-12) for row in expected]


def test_missing_inputs_are_named():
    with pytest.raises(ValueError, match=r"'gae' needs AdvantageInputs.values"):
        compute_advantages("gae", _group_inputs(), gamma=1.0, lam=1.0)
    no_groups = AdvantageInputs(token_level_rewards=_tensor(GROUP_REWARDS), response_mask=_mask(GROUP_MASK))
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        with pytest.raises(ValueError, match=rf"'{name}' needs AdvantageInputs.group_ids"):
            compute_advantages(name, no_groups, gamma=1.0, lam=1.0)


def test_shape_mismatch_and_unknown_estimator():
    bad = AdvantageInputs(token_level_rewards=_tensor(GROUP_REWARDS), response_mask=_mask(GAE_MASK))
    with pytest.raises(ValueError, match="response_mask"):
        compute_advantages("reinforce_plus_plus", bad, gamma=1.0, lam=1.0)
    with pytest.raises(KeyError, match="did you mean 'grpo'"):
        compute_advantages("grpoo", _group_inputs(), gamma=1.0, lam=1.0)


# ReMax: one row with an interior gap, a full row, an empty row and a tail-padded row.
REMAX_MASK = [[1, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 0, 0]]
REMAX_REWARDS = [
    [0.5, GARBAGE, -1.0, 2.0, GARBAGE],
    [0.1, 0.2, 0.3, 0.4, -1.0],
    [GARBAGE] * 5,
    [0.0, 0.0, 1.0, GARBAGE, GARBAGE],
]
REMAX_BASELINES = [0.5, -0.5, 3.0, 0.25]  # reward of each prompt's greedy response


def _remax(rewards: torch.Tensor | None = None, gamma: float = 1.0):
    inputs = AdvantageInputs(
        token_level_rewards=_tensor(REMAX_REWARDS) if rewards is None else rewards,
        response_mask=_mask(REMAX_MASK),
        reward_baselines=torch.tensor(REMAX_BASELINES, dtype=torch.float64),
    )
    return compute_advantages("remax", inputs, gamma=gamma, lam=1.0)


def test_remax_is_reward_to_go_minus_the_greedy_reward():
    out = _remax()
    # row 0 over its valid positions 0, 2, 3: 2; -1 + 2 = 1; 0.5 + 1 = 1.5 (position 1 skipped)
    # row 1: -1; 0.4 - 1 = -0.6; 0.3 - 0.6 = -0.3; 0.2 - 0.3 = -0.1; 0.1 - 0.1 = 0
    # row 2 is empty; row 3: 1, 1, 1
    returns = [[1.5, 0, 1.0, 2.0, 0], [0.0, -0.1, -0.3, -0.6, -1.0], [0.0] * 5, [1.0, 1.0, 1.0, 0, 0]]
    advantages = [
        [1.5 - 0.5, 0, 1.0 - 0.5, 2.0 - 0.5, 0],
        [0.0 + 0.5, -0.1 + 0.5, -0.3 + 0.5, -0.6 + 0.5, -1.0 + 0.5],
        [0.0] * 5,
        [0.75, 0.75, 0.75, 0, 0],
    ]
    assert out.returns.tolist() == [pytest.approx(row, abs=1e-12) for row in returns]
    assert out.advantages.tolist() == [pytest.approx(row, abs=1e-12) for row in advantages]


def test_remax_ignores_gamma_and_non_finite_padding():
    rewards = _tensor(REMAX_REWARDS)
    rewards[~_mask(REMAX_MASK).bool()] = float("inf")
    reference = _remax()
    out = _remax(rewards, gamma=0.5)
    assert torch.equal(out.advantages, reference.advantages)
    assert torch.equal(out.returns, reference.returns)


def test_remax_needs_baselines_of_one_per_sample():
    no_baselines = AdvantageInputs(
        token_level_rewards=_tensor(REMAX_REWARDS), response_mask=_mask(REMAX_MASK)
    )
    with pytest.raises(
        ValueError, match=r"^advantage estimator 'remax' needs AdvantageInputs.reward_baselines"
    ):
        compute_advantages("remax", no_baselines, gamma=1.0, lam=1.0)
    wrong = AdvantageInputs(
        token_level_rewards=_tensor(REMAX_REWARDS),
        response_mask=_mask(REMAX_MASK),
        reward_baselines=torch.zeros(3, dtype=torch.float64),
    )
    with pytest.raises(ValueError, match=r"reward_baselines must be \[batch\]=4, got \(3,\)"):
        compute_advantages("remax", wrong, gamma=1.0, lam=1.0)
    integer = AdvantageInputs(
        token_level_rewards=_tensor(REMAX_REWARDS),
        response_mask=_mask(REMAX_MASK),
        reward_baselines=torch.zeros(4, dtype=torch.int64),
    )
    with pytest.raises(ValueError, match="reward_baselines must be a float tensor"):
        compute_advantages("remax", integer, gamma=1.0, lam=1.0)
