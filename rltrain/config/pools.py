"""Resource pools: which devices each role runs on (``cluster.resource_pools`` and ``cluster.role_pool``).

The trainer's own pool, ``global_pool``, is ``cluster.nnodes × cluster.n_gpus_per_node`` devices:
the actor, the reference and colocated rollout engines always run there, one rank per device. Further
pools are named in ``cluster.resource_pools`` with their own size, and ``cluster.role_pool`` puts the
critic, the reward model or the separate rollout engines on one of them. Every role defaults to
``global_pool``: the critic and the reward model then share the actor's devices (each rank of each
role takes an equal share of its device), as before pools existed. Two roles named on one extra pool
share it the same way; that is a choice, not the only layout. A pool hosting the separate rollout
engines hosts nothing else (each engine holds its devices whole). A role's parallel layout
(``critic.parallel``, ``reward.reward_model.parallel``) must fit its pool's size, and the pools
together must fit the Ray cluster: both are checked before any worker starts, naming the role and pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from rltrain.config.fields import PositiveInt

GLOBAL_POOL = "global_pool"
"""The trainer's pool (verl's name): ``cluster.nnodes × cluster.n_gpus_per_node`` devices."""

POOLED_ROLES = ("critic", "reward_model", "rollout")
"""The roles ``cluster.role_pool`` places; actor, reference and colocated engines stay on ``global_pool``."""


@dataclass
class ResourcePoolConfig:
    nnodes: PositiveInt = 1
    """Nodes of the pool."""

    n_gpus_per_node: PositiveInt = 1
    """Devices of the pool on each of its nodes (on a CPU cluster: processes)."""

    def size(self) -> int:
        return self.nnodes * self.n_gpus_per_node


@dataclass
class RolePoolConfig:
    critic: str = GLOBAL_POOL
    """Pool of the critic's ranks."""

    reward_model: str = GLOBAL_POOL
    """Pool of the reward model's ranks (``reward.reward_model``)."""

    rollout: str | None = None
    """Pool of the separate rollout engines (``rollout.mode: separate``; its size must equal
    ``rollout.num_devices``); null: ``rollout.num_devices`` devices of their own, in no named pool.
    Colocated engines live on the actor's ranks and take no pool."""
