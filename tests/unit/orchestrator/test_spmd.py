"""The torchrun mode's group and stop agreement on a real gloo group of world size 1: a rank's
RunStopped arrives as itself in one line (not wrapped with a traceback), other errors as a
WorkerError naming role, rank and method; the ranks agree on a stop signal; what the mode cannot run
is refused in one line."""

import os
import signal

import pytest

from rltrain.config import ConfigError, load_config
from rltrain.errors import DivergenceError
from rltrain.orchestrator.spmd import SPMDGroup, agree_on_stop, check_world
from rltrain.trainer.preemption import StopSignals
from rltrain.trainer.recovery import WorkerError


class Worker:
    def diverge(self) -> None:
        raise DivergenceError("actor diverged: a parameter reached magnitude 5e+08 after an optimizer step")

    def divide(self, x: int) -> float:
        return x / 0

    def double(self, x: int) -> int:
        return 2 * x


def test_a_run_stop_travels_as_itself_and_other_errors_name_role_rank_method(gloo_world_of_one):
    group = SPMDGroup("actor_rollout_ref", Worker())
    assert group.call("double", 21) == [42]
    with pytest.raises(DivergenceError) as stopped:
        group.call("diverge")
    assert str(stopped.value) == (
        "actor_rollout_ref rank 0: actor diverged: a parameter reached magnitude 5e+08 after an optimizer step"
    )
    with pytest.raises(WorkerError, match=r"^actor_rollout_ref rank 0: divide failed: ZeroDivisionError"):
        group.call("divide", 1)


def test_the_ranks_agree_on_a_stop_signal(gloo_world_of_one):
    assert agree_on_stop(0) == 0 and agree_on_stop(int(signal.SIGUSR1)) == signal.SIGUSR1
    with StopSignals(agree=agree_on_stop).installed() as stop:
        assert stop.requested() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested() == "SIGUSR1"


def test_max_restarts_under_torchrun_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    config = load_config("recipes/quickstart_cpu.yaml", ["trainer.max_restarts=2"])
    with pytest.raises(ConfigError) as err:
        check_world(config)
    assert str(err.value) == (
        "invalid configuration: trainer.max_restarts=2 needs the Ray mode; under torchrun use torchrun "
        "--max-restarts (resume_mode auto continues from the last checkpoint)"
    )


def test_pools_and_the_reward_model_under_torchrun_are_refused_naming_the_keys(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    config = load_config(
        "recipes/quickstart_cpu.yaml",
        [
            "cluster.resource_pools.critic_pool.n_gpus_per_node=1",
            "cluster.role_pool.critic=critic_pool",
            "reward.reward_model.enable=true",
            "reward.reward_model.model.path=/models/rm",
        ],
    )
    with pytest.raises(ConfigError) as err:
        check_world(config)
    assert err.value.problems == [
        "cluster.role_pool.critic=critic_pool: torchrun mode runs every role on the launcher's processes; "
        "resource pools need the Ray mode",
        "reward.reward_model.enable=true: the reward model runs on workers of its own, which the Ray mode "
        "starts (rltrain train / ray job submit); torchrun mode has none",
    ]
