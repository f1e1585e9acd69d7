"""``model.mtp`` (verl's ``actor_rollout_ref.model.mtp``): MTP layers ignored by default, the loss
mode with its weight, bad combinations refused in one line naming the key."""

from pathlib import Path

import pytest

from rltrain.algo.loss_specs import ActorLoss
from rltrain.config import ConfigError, load_config
from rltrain.trainer.algorithms import build_algorithm

QUICKSTART = Path(__file__).resolve().parents[3] / "recipes" / "quickstart_cpu.yaml"


def _problems(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, overrides)
    return info.value.problems


def _actor_loss(overrides: list[str]) -> ActorLoss:
    """The actor loss the run's algorithm hands the updates."""
    return build_algorithm(load_config(QUICKSTART, overrides)).actor_loss


def test_mtp_is_ignored_by_default():
    config = load_config(QUICKSTART)
    assert not config.model.mtp.enable_train and config.model.mtp.mtp_loss_scaling_factor == 0.1
    assert _actor_loss([]).mtp_loss_scaling_factor is None
    # the weight alone does not turn the loss on
    assert _actor_loss(["model.mtp.mtp_loss_scaling_factor=0.3"]).mtp_loss_scaling_factor is None


def test_enable_train_puts_the_weight_into_the_actor_loss():
    overrides = ["model.mtp.enable_train=true", "model.mtp.mtp_loss_scaling_factor=0.3"]
    assert _actor_loss(overrides).mtp_loss_scaling_factor == 0.3


def test_a_negative_weight_is_refused_naming_the_key():
    (problem,) = _problems(["model.mtp.mtp_loss_scaling_factor=-0.1"])
    assert problem.endswith("model.mtp.mtp_loss_scaling_factor must be >= 0, got -0.1")


def test_training_mtp_under_context_parallelism_is_refused_naming_both_keys():
    overrides = [
        "model.mtp.enable_train=true",
        "actor.parallel.context_parallel_size=2",
        "cluster.n_gpus_per_node=2",
    ]
    (problem,) = _problems(overrides)
    assert problem.endswith(
        "model.mtp.enable_train with actor.parallel.context_parallel_size=2: "
        "the MTP loss is computed at context_parallel_size 1 only"
    )
    assert load_config(QUICKSTART, overrides[1:]).actor.parallel.context_parallel_size == 2


def test_verls_enable_key_is_unknown_and_the_closest_name_offered():
    (problem,) = _problems(["model.mtp.enable=true"])
    assert "model.mtp.enable" in problem and "enable_train" in problem


def test_detach_encoder_without_enable_train_is_refused_naming_both_keys():
    (problem,) = _problems(["model.mtp.detach_encoder=true"])
    assert problem.endswith(
        "model.mtp.detach_encoder needs model.mtp.enable_train: true (nothing trains the MTP layers)"
    )
    config = load_config(QUICKSTART, ["model.mtp.enable_train=true", "model.mtp.detach_encoder=true"])
    assert config.model.mtp.detach_encoder
