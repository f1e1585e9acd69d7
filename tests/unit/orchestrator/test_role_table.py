"""The role table: which roles a run has, their ranks, worker arguments and pools, against what the
config says by hand; a planted row is started and placed like the others. No Ray needed."""

import pytest

from rltrain.config import load_config
from rltrain.orchestrator import role_table
from rltrain.orchestrator.placement import rollout_placement, run_placement
from rltrain.orchestrator.role_table import ROLES, RoleRun, RoleSpec, pool_roles, run_roles
from rltrain.trainer.algorithms import build_algorithm
from rltrain.workers.model_workers import CriticWorker, PolicyWorker, RewardModelWorker
from rltrain.workers.rollout_worker import RolloutWorker
from tests.unit.orchestrator.test_placement import NAMED_POOLS


def run_of(tmp_path, *overrides: str) -> RoleRun:
    config = load_config(
        "recipes/quickstart_cpu.yaml",
        [
            f"trainer.default_local_dir={tmp_path}",
            "actor.ppo_micro_batch_size_per_gpu=8",
            "critic.ppo_micro_batch_size_per_gpu=8",
            *overrides,
        ],
    )
    return RoleRun(config, build_algorithm(config).needs, rollout_placement(config, gpu=False), total_steps=7)


def test_the_quickstart_has_the_policy_and_a_critic(tmp_path):
    run = run_of(tmp_path)  # GAE, KL in the reward
    assert [s.name for s in run_roles(run)] == ["actor_rollout_ref", "critic"]
    policy, critic = run_roles(run)
    assert policy.worker_class() is PolicyWorker and critic.worker_class() is CriticWorker
    assert policy.kwargs(run) == {"total_steps": 7, "placement": run.layout, "reference": True}
    assert critic.kwargs(run) == {"total_steps": 7}
    assert [s.world(run) for s in run_roles(run)] == [1, 1]
    assert pool_roles(run) == {"global_pool": ["actor", "critic"]}


def test_grpo_without_kl_has_neither_critic_nor_reference(tmp_path):
    run = run_of(tmp_path, "algorithm.adv_estimator=grpo", "rollout.n=2", "algorithm.use_kl_in_reward=false")
    assert [s.name for s in run_roles(run)] == ["actor_rollout_ref"]
    assert run_roles(run)[0].kwargs(run)["reference"] is False
    with_loss = run_of(
        tmp_path,
        "algorithm.adv_estimator=grpo",
        "rollout.n=2",
        "algorithm.use_kl_in_reward=false",
        "actor.use_kl_loss=true",
    )
    assert run_roles(with_loss)[0].kwargs(with_loss)["reference"] is True


def test_separate_engines_and_a_pooled_reward_model(tmp_path):
    run = run_of(tmp_path, *NAMED_POOLS)
    specs = run_roles(run)
    assert [s.name for s in specs] == ["actor_rollout_ref", "rollout", "critic", "reward_model"]
    assert [s.world(run) for s in specs] == [2, 1, 2, 1]  # 2 devices / TP 2 = 1 engine
    assert [s.worker_class() for s in specs[1::2]] == [RolloutWorker, RewardModelWorker]
    assert pool_roles(run) == {
        "global_pool": ["actor"],
        "critic_pool": ["critic"],
        "rm_pool": ["reward_model"],
    }
    # the config's own account of its pools (its validation reads it) agrees, the engines' pool aside
    assert pool_roles(run) == {
        k: [r for r in v if r != "rollout"] for k, v in run.config.pool_roles().items()
    }


def test_a_planted_row_is_started_and_placed(tmp_path, monkeypatch):
    """Adding a role is one row: a teacher on the critic's pool joins the run and shares the pool."""
    teacher = RoleSpec(
        "teacher",
        "the teacher",
        "rltrain.workers.model_workers:CriticWorker",
        pool="critic",
        enabled=lambda run: True,
        world=lambda run: run.config.role_world("critic"),
        handle="teacher",
    )
    monkeypatch.setattr(role_table, "ROLES", (*ROLES, teacher))
    run = run_of(tmp_path)
    assert [s.name for s in run_roles(run)] == ["actor_rollout_ref", "critic", "teacher"]
    assert pool_roles(run) == {"global_pool": ["actor", "critic", "critic"]}
    pools = run_placement(run.config, gpu=False)
    assert pools.pool_of("critic").share == pytest.approx(1 / 3)


def test_a_role_name_not_in_the_table_is_named():
    with pytest.raises(
        KeyError, match="no role 'teacher' in the role table; roles: actor_rollout_ref, rollout"
    ):
        role_table.role("teacher")
