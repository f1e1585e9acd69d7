"""The keys of sapo (``actor.tau_pos``, ``actor.tau_neg``) and dro (``actor.policy_loss.dro_beta``):
verl's defaults, and each bad value is one line naming its key."""

import pytest

from rltrain.config import ActorConfig, load_config

from .recipe_helpers import MINIMAL, errors_of, write


def test_defaults_are_verls():
    actor = ActorConfig()
    assert (actor.tau_pos, actor.tau_neg) == (1.0, 1.05)
    assert actor.policy_loss.dro_beta is None


def test_the_keys_load_from_overrides(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL)
    overrides = ["actor.policy_loss.loss_mode=dro", "actor.policy_loss.dro_beta=0.25", "actor.tau_neg=2"]
    actor = load_config(path, overrides).actor
    assert (actor.policy_loss.loss_mode, actor.policy_loss.dro_beta, actor.tau_neg) == ("dro", 0.25, 2.0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["actor.policy_loss.loss_mode=dro"],
            "override 'actor.policy_loss.loss_mode=dro': actor.policy_loss.dro_beta is null: "
            "actor.policy_loss.loss_mode=dro needs a value > 0",
        ),
        (
            ["actor.policy_loss.dro_beta=0"],
            "override 'actor.policy_loss.dro_beta=0': actor.policy_loss.dro_beta must be > 0, got 0.0",
        ),
        (["actor.tau_pos=0"], "override 'actor.tau_pos=0': actor.tau_pos must be > 0, got 0.0"),
        (["actor.tau_neg=-1"], "override 'actor.tau_neg=-1': actor.tau_neg must be > 0, got -1.0"),
    ],
)
def test_a_bad_value_is_one_line_naming_its_key(tmp_path, overrides, message):
    assert errors_of(write(tmp_path, "r.yaml", MINIMAL), overrides) == [message]
