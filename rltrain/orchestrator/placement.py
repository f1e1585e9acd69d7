"""Where the rollout engines sit, computed once from the config: :func:`rollout_placement`.

Pure (no Ray): the Ray entry reserves its placement-group bundles from it, the policy workers read
which ranks host an engine and the engine's tensor-parallel size, the torchrun mode builds its role
handles from it. The layout:

- the trainer has one bundle per device (``cluster.nnodes × cluster.n_gpus_per_node``); the policy
  worker (actor + reference, + a colocated engine) and the critic worker of rank i share bundle i;
- ``rollout.mode: colocated``: an engine of ``rollout.tensor_model_parallel_size`` (TP) workers on
  every TP-th trainer rank (ranks 0, TP, 2·TP, ...), sharing the devices of ranks r .. r+TP-1;
- ``rollout.mode: separate``: ``rollout.num_devices // TP`` engines on devices of their own, one
  bundle each (holding its TP devices) after the trainer's, weights broadcast from actor rank 0.

On a CPU-only cluster every bundle is one CPU (an engine's TP workers share it); with
``cluster.device_resource`` every bundle also reserves its devices as that Ray resource.

Resource pools (:func:`run_placement`, :mod:`rltrain.config.pools`): the critic and the reward model
run on ``global_pool`` (sharing bundle i with the policy worker of rank i) unless
``cluster.role_pool`` names another pool; each further pool gets bundles of its own after the
engines', one per device, shared by the roles placed on it. Separate engines on a named pool are the
engine bundles above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rltrain.config import RLConfig
from rltrain.config.pools import GLOBAL_POOL


@dataclass(frozen=True)
class Bundle:
    """The resources one placement-group bundle reserves."""

    num_cpus: int
    num_gpus: int
    """Devices of the bundle; 0 on a CPU-only cluster (the bundle then names no device at all)."""
    device_resource: str = "GPU"
    """The Ray resource a device is (``cluster.device_resource``; ``GPU`` unless a custom one)."""

    def resources(self) -> dict[str, int]:
        """Ray's bundle dict: ``{"CPU": c, "GPU": g}`` (or the custom device resource), or
        ``{"CPU": c}`` without devices."""
        if self.num_gpus:
            return {"CPU": self.num_cpus, self.device_resource: self.num_gpus}
        return {"CPU": self.num_cpus}


@dataclass(frozen=True)
class RolloutPlacement:
    """The rollout layout of a run (see the module docstring)."""

    mode: Literal["colocated", "separate"]
    """``rollout.mode``."""
    engine_tp: int
    """Tensor-parallel size of each engine (``rollout.tensor_model_parallel_size``)."""
    engine_ranks: tuple[int, ...]
    """Trainer ranks that host a colocated engine, ascending; empty when ``separate``."""
    num_engines: int
    """Engines of the run: ``len(engine_ranks)`` colocated, ``rollout.num_devices // engine_tp``
    separate."""
    trainer_bundles: tuple[Bundle, ...]
    """One per trainer device, in rank order (bundle i hosts rank i of every trainer role)."""
    engine_bundles: tuple[Bundle, ...]
    """One per separate engine (its TP devices), after the trainer's; empty when colocated."""

    @property
    def separate(self) -> bool:
        return self.mode == "separate"

    @property
    def bundles(self) -> tuple[Bundle, ...]:
        """Every bundle of the run's placement group: the trainer's, then the engines'."""
        return self.trainer_bundles + self.engine_bundles

    @property
    def first_engine_bundle(self) -> int:
        """Index of the first separate engine's bundle in :attr:`bundles`."""
        return len(self.trainer_bundles)


def _device(config: RLConfig, gpu: bool) -> tuple[bool, str]:
    """Whether bundles reserve devices, and as which Ray resource."""
    custom = config.cluster.device_resource
    return gpu or custom is not None, custom or "GPU"


def rollout_placement(config: RLConfig, *, gpu: bool) -> RolloutPlacement:
    """The rollout layout of ``config`` (already validated: TP divides what it must); ``gpu``: the
    cluster's devices are GPUs (bundles reserve them)."""
    rollout = config.rollout
    world, tp = config.cluster.world_size(), rollout.tensor_model_parallel_size
    separate = rollout.mode == "separate"
    engine_ranks = () if separate else tuple(range(0, world, tp))
    num_engines = rollout.num_devices // tp if separate else len(engine_ranks)
    devices, resource = _device(config, gpu)
    return RolloutPlacement(
        mode=rollout.mode,
        engine_tp=tp,
        engine_ranks=engine_ranks,
        num_engines=num_engines,
        trainer_bundles=(Bundle(num_cpus=1, num_gpus=1 if devices else 0, device_resource=resource),) * world,
        engine_bundles=(Bundle(num_cpus=1, num_gpus=tp if devices else 0, device_resource=resource),)
        * (num_engines if separate else 0),
    )


@dataclass(frozen=True)
class PoolPlacement:
    """The bundles of one resource pool and the trainer roles sharing them."""

    name: str
    """``global_pool`` or a ``cluster.resource_pools`` key."""
    roles: tuple[str, ...]
    """Trainer roles on the pool (``actor`` for the policy worker, ``critic``, ``reward_model``)."""
    first_bundle: int
    """Index of its first bundle in the run's placement group; rank r of each role is on
    ``first_bundle + r``."""
    size: int
    """Bundles (devices) of the pool: the ranks of each of its roles."""

    @property
    def share(self) -> float:
        """The part of a bundle's CPU and device each rank of each role reserves."""
        return 1.0 / len(self.roles)


@dataclass(frozen=True)
class RunPlacement:
    """Every pool of a run: the rollout layout, and where each trainer role's ranks go."""

    rollout: RolloutPlacement
    pools: tuple[PoolPlacement, ...]
    """``global_pool`` first, then the named pools of trainer roles (not the engines')."""
    extra_bundles: tuple[Bundle, ...]
    """The named trainer pools' bundles, after the rollout layout's."""

    @property
    def bundles(self) -> tuple[Bundle, ...]:
        """The run's placement group: trainer, separate engines, then the named trainer pools."""
        return self.rollout.bundles + self.extra_bundles

    def pool_of(self, role: str) -> PoolPlacement:
        """The pool hosting ``role`` (``actor``, ``critic``, ``reward_model``)."""
        for pool in self.pools:
            if role in pool.roles:
                return pool
        raise KeyError(f"no pool hosts {role!r}; pools: {[(p.name, p.roles) for p in self.pools]}")


def run_placement(config: RLConfig, *, gpu: bool) -> RunPlacement:
    """The pools of ``config`` (validated: each named pool used, engines alone on theirs)."""
    rollout = rollout_placement(config, gpu=gpu)
    devices, resource = _device(config, gpu)
    pools, extra, first = [], [], len(rollout.bundles)
    from rltrain.orchestrator.role_table import RoleRun, pool_roles
    from rltrain.trainer.algorithms import build_algorithm

    run = RoleRun(config, build_algorithm(config).needs, rollout, total_steps=0)
    for name, roles in pool_roles(run).items():  # the separate engines: the rollout layout's bundles
        trainer_roles = tuple(roles)
        if name == GLOBAL_POOL:
            pools.append(PoolPlacement(name, trainer_roles, 0, config.cluster.world_size()))
            continue
        size = config.cluster.pool_size(name)
        pools.append(PoolPlacement(name, trainer_roles, first, size))
        extra += [Bundle(num_cpus=1, num_gpus=1 if devices else 0, device_resource=resource)] * size
        first += size
    return RunPlacement(rollout=rollout, pools=tuple(pools), extra_bundles=tuple(extra))


def node_groups(placed: RunPlacement, config: RLConfig) -> tuple[tuple[int, int], ...]:
    """The run's bundles cut into the groups that must each sit on one node, ``(first bundle,
    count)``: every pool's bundles in runs of one node's devices (``n_gpus_per_node`` of the cluster,
    or of the named pool; a separate engine's bundle holds its TP devices, and an engine never
    straddles two nodes). So rank r of a trainer role is on the pool's node r // n_gpus_per_node
    (its tensor-parallel peers beside it, as verl places them), and a node holds whole engines."""
    cluster = config.cluster

    def node_size(pool: str | None) -> int:  # devices of one node of the pool
        named = pool not in (None, GLOBAL_POOL)
        return cluster.resource_pools[pool].n_gpus_per_node if named else cluster.n_gpus_per_node

    rollout = placed.rollout
    runs = [(0, len(rollout.trainer_bundles), node_size(GLOBAL_POOL))]
    if rollout.engine_bundles:  # whole engines a node
        engines_a_node = max(1, node_size(cluster.role_pool.rollout) // rollout.engine_tp)
        runs.append((rollout.first_engine_bundle, len(rollout.engine_bundles), engines_a_node))
    runs += [(p.first_bundle, p.size, node_size(p.name)) for p in placed.pools if p.name != GLOBAL_POOL]
    cuts = []
    for first, count, step in runs:
        cuts += [(start, min(step, first + count - start)) for start in range(first, first + count, step)]
    return tuple(cuts)
