"""Resource pools on a real Ray, with the shared Ray's custom resource standing in for GPUs
(``cluster.device_resource``): roles on separate pools get disjoint bundles, roles on one pool share
its bundles, and pools that do not fit the cluster are refused before anything is reserved, naming
the pools."""

import re
from types import SimpleNamespace

import pytest

from rltrain.config import load_config
from rltrain.orchestrator.run_workers import RunWorkers
from rltrain.orchestrator.worker_group import PoolsDoNotFit, RayWorkerGroup
from tests.e2e.conftest import STAND_IN_GPU

RM = ["reward.reward_model.enable=true", "reward.reward_model.model.path=/models/rm"]


class Probe:
    """A worker reporting the resources Ray gave its process."""

    def __init__(self, *args) -> None:
        pass

    def assigned(self) -> dict[str, float]:
        """Ray's own account of this actor's resources, bundle-indexed (``get_assigned_resources``
        drops the bundle; the core worker keeps it)."""
        import ray

        ids = ray._private.worker.global_worker.core_worker.resource_ids()
        return {name: sum(amount for _, amount in slots) for name, slots in ids.items()}

    def rank_info(self) -> dict[str, int]:
        return {}


def _config(tmp_path, *overrides):
    return load_config(
        "recipes/quickstart_cpu.yaml",
        [
            f"trainer.default_local_dir={tmp_path}",
            f"cluster.device_resource={STAND_IN_GPU}",
            "trainer.timeouts.init_s=30",
            *RM,
            *overrides,
        ],
    )


def _bundles_of(workers: RunWorkers, role: str, config) -> list[tuple[int, dict[str, float]]]:
    """(bundle index, device share) of each rank of ``role``, from what Ray assigned it: a resource in
    a placement group is named ``<resource>_group_<bundle>_<group id>``."""
    group = RayWorkerGroup(
        role, Probe, world_size=config.role_world(role), placement=workers.placement_of(role)
    )
    workers.groups.append(group)
    first = {
        pg.id.hex(): f for pg, (f, _) in zip(workers.pg.groups, workers.pg.cuts)
    }  # one group a node's share
    indexed = re.compile(rf"{STAND_IN_GPU}_group_(\d+)_([0-9a-f]+)")
    out = []
    for assigned in group.call("assigned"):
        ((bundle, share),) = (
            (first[m[2]] + int(m[1]), v)
            for k, v in assigned.items()
            if (m := indexed.fullmatch(k)) and m[2] in first
        )
        out.append((bundle, share))
    return out


def test_roles_on_separate_pools_get_disjoint_bundles(local_ray, tmp_path):
    config = _config(
        tmp_path,
        "cluster.resource_pools.critic_pool.n_gpus_per_node=1",
        "cluster.resource_pools.rm_pool.n_gpus_per_node=1",
        "cluster.role_pool.critic=critic_pool",
        "cluster.role_pool.reward_model=rm_pool",
    )
    workers = RunWorkers(config, SimpleNamespace(model_dir="", total_steps=1), gpu=False)
    try:
        placed = {role: _bundles_of(workers, role, config) for role in ("actor", "critic", "reward_model")}
    finally:
        workers.release()
    # one device each, whole: actor on bundle 0, critic 1, reward model 2
    assert placed == {"actor": [(0, 1.0)], "critic": [(1, 1.0)], "reward_model": [(2, 1.0)]}


def test_roles_on_one_pool_share_its_bundles(local_ray, tmp_path):
    config = _config(
        tmp_path,
        "cluster.resource_pools.aux.n_gpus_per_node=1",
        "cluster.role_pool.critic=aux",
        "cluster.role_pool.reward_model=aux",
    )
    workers = RunWorkers(config, SimpleNamespace(model_dir="", total_steps=1), gpu=False)
    try:
        placed = {role: _bundles_of(workers, role, config) for role in ("actor", "critic", "reward_model")}
    finally:
        workers.release()
    assert placed == {"actor": [(0, 1.0)], "critic": [(1, 0.5)], "reward_model": [(1, 0.5)]}


def test_pools_that_do_not_fit_the_cluster_are_refused_naming_them(local_ray, tmp_path):
    config = _config(
        tmp_path,
        "cluster.resource_pools.rm_pool.n_gpus_per_node=8",
        "cluster.role_pool.reward_model=rm_pool",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=8",
    )
    with pytest.raises(PoolsDoNotFit) as info:
        RunWorkers(config, SimpleNamespace(model_dir="", total_steps=1), gpu=False)
    assert str(info.value) == (
        "the run's resource pools (global_pool 1, rm_pool 8 devices: cluster.nnodes × cluster.n_gpus_per_node, "
        "cluster.resource_pools, rollout.num_devices) need 9 CPU (the cluster has 4), "
        f"9 {STAND_IN_GPU} (the cluster has 4)"
    )
