"""The role table: every role a run may start, one row each (:data:`ROLES`).

A row says what a role is called, which class runs on each of its ranks (imported where the ranks
start), which driver-side handle the loop talks to it through, which resource pool its ranks sit on,
how many there are, and when the run has it: the run's algorithm (:attr:`rltrain.trainer.algorithms.Algorithm.needs`)
and its rollout layout decide. The Ray launcher (:class:`~rltrain.orchestrator.run_workers.RunWorkers`),
the torchrun mode (:mod:`~rltrain.orchestrator.spmd`) and the resource pools
(:func:`~rltrain.orchestrator.placement.run_placement`) all read it. Adding a role (a teacher, say)
is one row here and one worker class in :mod:`rltrain.workers` (and a handle in
:mod:`rltrain.trainer.roles` when the loop calls it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rltrain.config import RLConfig
    from rltrain.orchestrator.placement import RolloutPlacement
    from rltrain.trainer.algorithms import Needs


@dataclass(frozen=True)
class RoleRun:
    """What the table's functions see of a run."""

    config: RLConfig
    needs: Needs
    """The run's algorithm's models (:class:`~rltrain.trainer.algorithms.Needs`)."""
    layout: RolloutPlacement
    """Where the rollout engines sit."""
    total_steps: int


@dataclass(frozen=True)
class RoleSpec:
    name: str
    """The role's name: its worker group's, in status lines, errors and timeouts."""
    title: str
    """What the status line calls it while its ranks start."""
    worker: str
    """``module:Class`` of what runs on each rank, built as ``Class(config, model_dir, info, **kwargs)``."""
    pool: str
    """Whose bundles its ranks take: ``actor`` (``global_pool``), ``critic`` or ``reward_model``
    (``cluster.role_pool.<role>``), or ``rollout`` (the separate engines' bundles)."""
    enabled: Callable[[RoleRun], bool]
    """Whether the run has the role."""
    world: Callable[[RoleRun], int]
    """Its ranks."""
    handle: str | None = None
    """The :class:`~rltrain.trainer.driver.Roles` field its driver-side handle fills (None: none of
    its own; the separate engines are the policy handle's)."""
    kwargs: Callable[[RoleRun], dict[str, Any]] = field(default=lambda run: {})
    """Keyword arguments of the worker class."""
    torchrun: bool = False
    """Whether the torchrun mode hosts it in the rank's own process (else that mode refuses a run
    that has it)."""

    def worker_class(self) -> type:
        module, _, name = self.worker.partition(":")
        return getattr(importlib.import_module(module), name)


ROLES: tuple[RoleSpec, ...] = (
    RoleSpec(
        "actor_rollout_ref",
        "the actor, reference and rollout engine",
        "rltrain.workers.model_workers:PolicyWorker",
        pool="actor",
        enabled=lambda run: True,
        world=lambda run: run.config.cluster.world_size(),
        handle="policy",
        kwargs=lambda run: {
            "total_steps": run.total_steps,
            "placement": run.layout,
            "reference": run.needs.reference,
        },
        torchrun=True,
    ),
    RoleSpec(
        "rollout",
        "the rollout engines",
        "rltrain.workers.rollout_worker:RolloutWorker",
        pool="rollout",
        enabled=lambda run: run.layout.separate,
        world=lambda run: run.layout.num_engines,
    ),
    RoleSpec(
        "critic",
        "the critic",
        "rltrain.workers.model_workers:CriticWorker",
        pool="critic",
        enabled=lambda run: run.needs.critic,
        world=lambda run: run.config.role_world("critic"),
        handle="critic",
        kwargs=lambda run: {"total_steps": run.total_steps},
        torchrun=True,
    ),
    RoleSpec(
        "reward_model",
        "the reward model",
        "rltrain.workers.model_workers:RewardModelWorker",
        pool="reward_model",
        enabled=lambda run: run.needs.reward_model,
        world=lambda run: run.config.role_world("reward_model"),
        handle="reward_model",
    ),
)


def role(name: str) -> RoleSpec:
    """The row of ``name``."""
    for spec in ROLES:
        if spec.name == name:
            return spec
    raise KeyError(f"no role {name!r} in the role table; roles: {', '.join(s.name for s in ROLES)}")


def run_roles(run: RoleRun) -> list[RoleSpec]:
    """The rows of the roles ``run`` has, in table order."""
    return [spec for spec in ROLES if spec.enabled(run)]


def pool_roles(run: RoleRun) -> dict[str, list[str]]:
    """Each resource pool the run's trainer roles use → the roles on it (``actor`` on ``global_pool``;
    the separate engines' bundles are the rollout layout's, in no trainer pool)."""
    from rltrain.config.pools import GLOBAL_POOL

    pools: dict[str, list[str]] = {}
    for spec in run_roles(run):
        if spec.pool == "rollout":
            continue
        name = GLOBAL_POOL if spec.pool == "actor" else getattr(run.config.cluster.role_pool, spec.pool)
        pools.setdefault(name, []).append(spec.pool)
    return pools
