"""Registering an advantage estimator: the decorator makes it selectable by name, in
``compute_advantages`` and in ``algorithm.adv_estimator``, with what it declared it reads driving
the config's checks (a critic for ``values``, ``rollout.n >= 2`` for ``group_ids``); an unknown
name fails naming the closest registered one."""

import pytest
import torch

from rltrain.algo import (
    ADV_ESTIMATORS,
    AdvantageInputs,
    AdvantageOutput,
    AdvantageParams,
    UnknownNameError,
    compute_advantages,
    register_adv_estimator,
)
from rltrain.config import load_config
from tests.unit.config.recipe_helpers import MINIMAL, errors_of, write


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by the test are gone after it (the registry has no unregister)."""
    monkeypatch.setattr(ADV_ESTIMATORS, "_entries", dict(ADV_ESTIMATORS._entries))


def _gamma_scaled_rewards(inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """A toy estimator: each valid token's reward times gamma, its values added as returns."""
    mask = inputs.response_mask.to(inputs.token_level_rewards.dtype)
    advantages = inputs.token_level_rewards * params.gamma * mask
    returns = advantages + (inputs.values * mask if inputs.values is not None else 0.0)
    return AdvantageOutput(advantages=advantages, returns=returns)


def test_a_registered_estimator_is_run_by_name(scratch_registry: None) -> None:
    assert register_adv_estimator("scaled")(_gamma_scaled_rewards) is _gamma_scaled_rewards
    inputs = AdvantageInputs(
        token_level_rewards=torch.tensor([[1.0, 2.0, 9.0], [0.5, 0.0, 4.0]]),
        response_mask=torch.tensor([[1, 1, 0], [1, 0, 1]]),
        values=torch.tensor([[0.25, 0.5, 7.0], [1.0, 3.0, 2.0]]),
    )
    out = compute_advantages("scaled", inputs, gamma=0.5, lam=1.0)
    assert out.advantages.tolist() == [[0.5, 1.0, 0.0], [0.25, 0.0, 2.0]]
    assert out.returns.tolist() == [[0.75, 1.5, 0.0], [1.25, 0.0, 4.0]]
    assert "scaled" in ADV_ESTIMATORS.names()


def test_a_registered_estimator_is_selectable_in_the_config(scratch_registry: None, tmp_path) -> None:
    register_adv_estimator("scaled")(_gamma_scaled_rewards)
    register_adv_estimator("scaled_groups", needs=("group_ids",))(_gamma_scaled_rewards)
    register_adv_estimator("scaled_values", needs=("values",))(_gamma_scaled_rewards)
    path = write(tmp_path, "r.yaml", MINIMAL)
    config = load_config(path, ["algorithm.adv_estimator=scaled"])
    assert config.algorithm.adv_estimator == "scaled" and not config.critic_enabled()
    assert load_config(path, ["algorithm.adv_estimator=scaled_values"]).critic_enabled()
    assert load_config(path, ["algorithm.adv_estimator=scaled_groups", "rollout.n=2"]).rollout.n == 2
    assert errors_of(path, ["algorithm.adv_estimator=scaled_groups"]) == [
        "override 'algorithm.adv_estimator=scaled_groups': algorithm.adv_estimator=scaled_groups compares "
        "samples of one prompt: needs rollout.n >= 2, got 1"
    ]
    assert errors_of(path, ["algorithm.adv_estimator=scaled_values", "critic.enable=false"]) == [
        "override 'algorithm.adv_estimator=scaled_values', override 'critic.enable=false': "
        "algorithm.adv_estimator=scaled_values needs values: critic.enable=false is incompatible"
    ]


def test_an_unknown_name_names_the_closest_registered_one() -> None:
    inputs = AdvantageInputs(token_level_rewards=torch.zeros(1, 2), response_mask=torch.ones(1, 2))
    with pytest.raises(UnknownNameError) as caught:
        compute_advantages("rlooo", inputs, gamma=1.0, lam=1.0)
    assert str(caught.value) == (
        "unknown advantage estimator 'rlooo'; registered: gae, gpg, grpo, grpo_passk, opo, "
        "reinforce_plus_plus, reinforce_plus_plus_baseline, remax, rloo; did you mean 'rloo'?"
    )


def test_bad_registrations_are_refused(scratch_registry: None) -> None:
    with pytest.raises(ValueError, match=r"^advantage estimator 'gae' is already registered"):
        register_adv_estimator("gae", needs=("values",))(_gamma_scaled_rewards)
    with pytest.raises(ValueError) as caught:
        register_adv_estimator("critic_free", needs=("value",))
    assert str(caught.value) == (
        "advantage estimator 'critic_free': needs ['value'] are not among values, group_ids, reward_baselines"
    )
    assert "critic_free" not in ADV_ESTIMATORS
