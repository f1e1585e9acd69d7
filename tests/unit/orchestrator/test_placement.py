"""Rollout placement: engine ranks, engine count and bundles by hand, for each mode; no Ray needed."""

import subprocess
import sys
from pathlib import Path

import pytest

from rltrain.config import load_config
from rltrain.orchestrator.placement import Bundle, RolloutPlacement, rollout_placement

REPO_ROOT = Path(__file__).resolve().parents[3]


NAMED_POOLS = (
    "cluster.n_gpus_per_node=2",
    "rollout.mode=separate",
    "rollout.num_devices=2",
    "rollout.tensor_model_parallel_size=2",
    "cluster.resource_pools.critic_pool.n_gpus_per_node=2",
    "cluster.resource_pools.rm_pool.n_gpus_per_node=1",
    "cluster.role_pool.critic=critic_pool",
    "cluster.role_pool.reward_model=rm_pool",
    "reward.reward_model.enable=true",
    "reward.reward_model.model.path=/models/rm",
)
"""Two trainer devices, one separate TP=2 engine, the critic and the reward model on pools of their own."""


def config(tmp_path, *overrides: str):
    """The quickstart recipe, micro-batches small enough for up to four data-parallel ranks."""
    return load_config(
        REPO_ROOT / "recipes/quickstart_cpu.yaml",
        [
            f"trainer.default_local_dir={tmp_path}",
            "actor.ppo_micro_batch_size_per_gpu=8",
            "critic.ppo_micro_batch_size_per_gpu=8",
            *overrides,
        ],
    )


def test_colocated_tp1_puts_an_engine_on_every_rank(tmp_path):
    layout = rollout_placement(config(tmp_path, "cluster.n_gpus_per_node=4"), gpu=True)
    assert layout == RolloutPlacement(
        mode="colocated",
        engine_tp=1,
        engine_ranks=(0, 1, 2, 3),
        num_engines=4,
        trainer_bundles=(Bundle(num_cpus=1, num_gpus=1),) * 4,
        engine_bundles=(),
    )
    assert not layout.separate
    assert [b.resources() for b in layout.bundles] == [{"CPU": 1, "GPU": 1}] * 4


def test_colocated_tp2_puts_an_engine_on_every_second_rank(tmp_path):
    cfg = config(tmp_path, "cluster.n_gpus_per_node=4", "rollout.tensor_model_parallel_size=2")
    layout = rollout_placement(cfg, gpu=True)
    assert (layout.engine_tp, layout.engine_ranks, layout.num_engines) == (2, (0, 2), 2)
    assert layout.engine_bundles == ()
    assert [b.resources() for b in layout.bundles] == [{"CPU": 1, "GPU": 1}] * 4


def test_colocated_on_cpus_reserves_one_cpu_per_rank(tmp_path):
    cfg = config(
        tmp_path, "cluster.nnodes=2", "cluster.n_gpus_per_node=2", "rollout.tensor_model_parallel_size=2"
    )
    layout = rollout_placement(cfg, gpu=False)
    assert layout.engine_ranks == (0, 2)
    assert [b.resources() for b in layout.bundles] == [{"CPU": 1}] * 4


def test_separate_engines_get_bundles_of_their_own_after_the_trainer(tmp_path):
    cfg = config(
        tmp_path,
        "cluster.n_gpus_per_node=2",
        "rollout.mode=separate",
        "rollout.num_devices=4",
        "rollout.tensor_model_parallel_size=2",
    )
    gpu = rollout_placement(cfg, gpu=True)
    assert (gpu.mode, gpu.engine_tp, gpu.engine_ranks, gpu.num_engines) == ("separate", 2, (), 2)
    assert gpu.separate and gpu.first_engine_bundle == 2
    assert [b.resources() for b in gpu.bundles] == [{"CPU": 1, "GPU": 1}] * 2 + [{"CPU": 1, "GPU": 2}] * 2
    cpu = rollout_placement(cfg, gpu=False)
    assert (cpu.engine_ranks, cpu.num_engines, cpu.first_engine_bundle) == ((), 2, 2)
    assert [b.resources() for b in cpu.bundles] == [{"CPU": 1}] * 4


def test_policy_role_refuses_a_separate_group_that_contradicts_the_placement(tmp_path):
    from rltrain.trainer.roles import PolicyRole

    colocated = rollout_placement(config(tmp_path), gpu=False)
    with pytest.raises(ValueError, match=r"rollout\.mode=colocated needs no separate engine group"):
        PolicyRole(group=None, placement=colocated, separate=object())
    separate = rollout_placement(
        config(tmp_path, "rollout.mode=separate", "rollout.num_devices=1"), gpu=False
    )
    with pytest.raises(ValueError, match=r"rollout\.mode=separate needs a separate engine group"):
        PolicyRole(group=None, placement=separate)


def test_placement_imports_without_ray():
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'ray':\n"
        "            raise ImportError(f'blocked import of {name}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import rltrain.orchestrator.placement\n"
        "assert 'ray' not in sys.modules\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_named_pools_get_bundles_of_their_own_after_the_engines(tmp_path):
    from rltrain.orchestrator.placement import PoolPlacement, run_placement

    cfg = config(tmp_path, *NAMED_POOLS)
    layout = run_placement(cfg, gpu=True)
    # trainer 0-1, the one TP=2 engine 2, critic 3-4, reward model 5
    assert layout.pools == (
        PoolPlacement("global_pool", ("actor",), 0, 2),
        PoolPlacement("critic_pool", ("critic",), 3, 2),
        PoolPlacement("rm_pool", ("reward_model",), 5, 1),
    )
    assert [b.resources() for b in layout.bundles] == (
        [{"CPU": 1, "GPU": 1}] * 2 + [{"CPU": 1, "GPU": 2}] + [{"CPU": 1, "GPU": 1}] * 3
    )
    assert [layout.pool_of(r).share for r in ("actor", "critic", "reward_model")] == [1.0, 1.0, 1.0]
    # a custom device resource on a CPU cluster counts the devices in its place
    custom = run_placement(config(tmp_path, "cluster.device_resource=stand_in_gpu"), gpu=False)
    assert [b.resources() for b in custom.bundles] == [{"CPU": 1, "stand_in_gpu": 1}]
    assert custom.pools == (PoolPlacement("global_pool", ("actor", "critic"), 0, 1),)
    assert custom.pool_of("critic").share == 0.5


def test_roles_sharing_a_named_pool_split_its_bundles(tmp_path):
    from rltrain.orchestrator.placement import PoolPlacement, run_placement

    cfg = config(
        tmp_path,
        "cluster.resource_pools.aux.n_gpus_per_node=2",
        "cluster.role_pool.critic=aux",
        "cluster.role_pool.reward_model=aux",
        "reward.reward_model.enable=true",
        "reward.reward_model.model.path=/models/rm",
    )
    layout = run_placement(cfg, gpu=False)
    assert layout.pools == (
        PoolPlacement("global_pool", ("actor",), 0, 1),
        PoolPlacement("aux", ("critic", "reward_model"), 1, 2),
    )
    assert [b.resources() for b in layout.bundles] == [{"CPU": 1}] * 3
    assert layout.pool_of("reward_model").share == 0.5


def test_each_node_share_of_each_pool_is_one_group_of_bundles(tmp_path):
    """By hand: the trainer's bundles in runs of n_gpus_per_node (rank r on node r // n_gpus_per_node,
    its TP peers beside it), whole separate engines per node, a named pool in runs of its own node
    size."""
    from rltrain.orchestrator.placement import node_groups, run_placement

    # 2 nodes × 2 trainer devices; 2 separate TP=2 engines (one a node); the critic on 2 × 2 of its own
    cfg = config(
        tmp_path,
        "cluster.nnodes=2",
        "cluster.n_gpus_per_node=2",
        "rollout.mode=separate",
        "rollout.num_devices=4",
        "rollout.tensor_model_parallel_size=2",
        "cluster.resource_pools.critic_pool.nnodes=2",
        "cluster.resource_pools.critic_pool.n_gpus_per_node=2",
        "cluster.role_pool.critic=critic_pool",
    )
    assert node_groups(run_placement(cfg, gpu=True), cfg) == ((0, 2), (2, 2), (4, 1), (5, 1), (6, 2), (8, 2))
    # the NAMED_POOLS layout on one node: trainer 0-1, the TP=2 engine 2, critic 3-4, reward model 5
    named = config(tmp_path, *NAMED_POOLS)
    assert node_groups(run_placement(named, gpu=True), named) == ((0, 2), (2, 1), (3, 2), (5, 1))
    # colocated quickstart: one group of its one device
    quick = config(tmp_path)
    assert node_groups(run_placement(quick, gpu=False), quick) == ((0, 1),)


def test_the_placement_record_names_each_rank_and_engine_node():
    """By hand: two policy ranks on two nodes with a colocated engine each, the critic on one."""
    from types import SimpleNamespace

    from rltrain.orchestrator.node_groups import placement_lines, placement_record

    a, b = ("a" * 56, "10.0.0.1"), ("b" * 56, "10.0.0.2")
    groups = {
        "actor_rollout_ref": SimpleNamespace(pids=[11, 12], nodes=[a, b]),
        "critic": SimpleNamespace(pids=[21, 22], nodes=[a, a]),
    }
    record = placement_record(groups, engine_ranks=(0, 1))
    assert record["actor_rollout_ref"][1] == {"rank": 1, "node_id": b[0], "node_ip": "10.0.0.2", "pid": 12}
    assert record["engines"] == [
        {"engine": 0, "node_id": a[0], "host": "actor_rollout_ref rank 0"},
        {"engine": 1, "node_id": b[0], "host": "actor_rollout_ref rank 1"},
    ]
    assert placement_lines(record) == [
        "placement: actor_rollout_ref: rank 0 on node aaaaaaaa (10.0.0.1); rank 1 on node bbbbbbbb (10.0.0.2)",
        "placement: critic: ranks 0-1 on node aaaaaaaa (10.0.0.1)",
    ]
