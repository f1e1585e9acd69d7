"""Registry lookups, and the names registered by the algorithm modules."""

import pytest

from rltrain.algo import ADV_ESTIMATORS, AGG_MODES, KL_CONTROLLERS, KL_ESTIMATORS, POLICY_LOSSES
from rltrain.algo.registry import Registry, UnknownNameError


def _registry() -> Registry[int]:
    registry: Registry[int] = Registry("widget")
    registry.register("grpo")(1)
    registry.register("gae")(2)
    registry.register("reinforce_plus_plus")(3)
    return registry


def test_register_get_and_names():
    registry = _registry()
    assert registry.get("gae") == 2
    assert registry.names() == ("gae", "grpo", "reinforce_plus_plus")
    assert "grpo" in registry
    assert "ppo" not in registry


def test_decorator_returns_the_function_unchanged():
    registry: Registry = Registry("thing")

    @registry.register("double")
    def double(x: int) -> int:
        return 2 * x

    assert double(3) == 6
    assert registry.get("double") is double


def test_unknown_name_lists_names_and_closest_match():
    registry = _registry()
    with pytest.raises(UnknownNameError) as info:
        registry.get("gpro")
    message = str(info.value)
    assert message == (
        "unknown widget 'gpro'; registered: gae, grpo, reinforce_plus_plus; did you mean 'grpo'?"
    )


def test_unknown_name_is_both_key_and_value_error():
    registry = _registry()
    with pytest.raises(KeyError):
        registry.get("reinforce++")
    with pytest.raises(ValueError, match="did you mean 'reinforce_plus_plus'"):
        registry.get("reinforce_plus")


def test_no_suggestion_when_nothing_is_close():
    with pytest.raises(KeyError) as info:
        _registry().get("zzzzzzzz")
    assert "did you mean" not in str(info.value)
    assert "registered: gae, grpo, reinforce_plus_plus" in str(info.value)


def test_duplicate_registration_is_an_error():
    registry = _registry()
    with pytest.raises(ValueError, match="'gae' is already registered"):
        registry.register("gae")(5)
    assert registry.get("gae") == 2


def test_algorithm_registries_hold_verl_names():
    assert ADV_ESTIMATORS.names() == (
        "gae",
        "gpg",
        "grpo",
        "grpo_passk",
        "opo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "rloo",
    )
    base_kl = ("abs", "k1", "k2", "k3", "kl", "low_var_kl", "mse")
    assert KL_ESTIMATORS.names() == tuple(sorted(base_kl + tuple(f"{name}+" for name in base_kl)))
    assert KL_CONTROLLERS.names() == ("adaptive", "fixed")
    assert POLICY_LOSSES.names() == (
        "cispo",
        "clip_cov",
        "dppo_kl",
        "dppo_tv",
        "dro",
        "geo_mean",
        "gpg",
        "gspo",
        "kl_cov",
        "reinforce",
        "sapo",
        "vanilla",
    )
    assert AGG_MODES.names() == (
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "token-mean",
        "token-sum",
    )
