"""The advantage estimators added beside verl's originals (remax, opo, gpg, grpo_passk): each is
selectable from YAML, none trains a critic, and the combinations that cannot work are refused in one
line naming the keys."""

import pytest

from rltrain.config import load_config

from .recipe_helpers import MINIMAL, errors_of, write


@pytest.mark.parametrize(
    ("name", "n"), [("remax", 1), ("remax", 4), ("opo", 4), ("gpg", 2), ("grpo_passk", 4)]
)
def test_new_estimators_are_selectable_and_critic_free(tmp_path, name, n):
    path = write(tmp_path, "r.yaml", MINIMAL)
    config = load_config(path, [f"algorithm.adv_estimator={name}", f"rollout.n={n}"])
    assert config.algorithm.adv_estimator == name
    assert not config.critic_enabled()


@pytest.mark.parametrize("name", ["opo", "gpg", "grpo_passk"])
def test_group_estimators_need_several_samples_per_prompt(tmp_path, name):
    path = write(tmp_path, "r.yaml", MINIMAL)
    assert errors_of(path, [f"algorithm.adv_estimator={name}"]) == [
        f"override 'algorithm.adv_estimator={name}': "
        f"algorithm.adv_estimator={name} compares samples of one prompt: needs rollout.n >= 2, got 1"
    ]


def test_remax_with_a_critic_is_refused(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL)
    assert errors_of(path, ["algorithm.adv_estimator=remax", "critic.enable=true"]) == [
        "override 'critic.enable=true', override 'algorithm.adv_estimator=remax': "
        "critic.enable=true but algorithm.adv_estimator=remax does not use values"
    ]


def test_a_misspelt_estimator_names_the_closest(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL)
    (problem,) = errors_of(path, ["algorithm.adv_estimator=grpo_pass"])
    assert problem == (
        "override 'algorithm.adv_estimator=grpo_pass': algorithm.adv_estimator: unknown advantage "
        "estimator 'grpo_pass'; registered: gae, gpg, grpo, grpo_passk, opo, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline, remax, rloo; did you mean 'grpo_passk'?"
    )
