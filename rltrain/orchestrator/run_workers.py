"""The run's Ray worker groups: placement of every role's ranks, their start, restart and release.

Placement (:func:`~rltrain.orchestrator.placement.run_placement`, read by every worker too): one
placement-group bundle per device (``nnodes × n_gpus_per_node``); the policy worker (actor +
reference + rollout engine) and the critic and reward-model workers of rank i share bundle i
(colocated) unless ``cluster.role_pool`` puts them on pools of their own (bundles after the rest).
With ``rollout.mode: separate`` each engine gets a bundle of its own after the trainer's, and weights
travel from actor rank 0 by broadcast. The pools must fit the Ray cluster (checked before reserving).
Every group of a run shares one :class:`~rltrain.orchestrator.liveness.Liveness`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rltrain.config import RLConfig
from rltrain.logging.console import stage

if TYPE_CHECKING:
    from rltrain.trainer.run import RunSetup

log = logging.getLogger(__name__)


def roles_stage(roles: list[tuple[str, int]]):
    """The status lines around starting roles at once: ``(title, num_ranks)`` each (the title: the
    role table's)."""
    named = [f"{title} ({n} rank{'s' if n > 1 else ''})" for title, n in roles]
    return stage("starting " + (f"{', '.join(named[:-1])} and {named[-1]}" if len(named) > 1 else named[0]))


def role_stage(role: str, num_ranks: int):
    """The status lines around starting ``num_ranks`` ranks of ``role`` (a role table name)."""
    from rltrain.orchestrator.role_table import role as spec

    return roles_stage([(spec(role).title, num_ranks)])


def pool_sizes(config: RLConfig) -> dict[str, int]:
    """Devices of each pool the run reserves, named as the config names them (the separate engines
    without a named pool as ``rollout.num_devices``)."""
    sizes = {name: config.cluster.pool_size(name) for name in config.pool_roles()}
    if config.rollout.mode == "separate" and config.cluster.role_pool.rollout is None:
        sizes["rollout.num_devices"] = config.rollout.num_devices
    return sizes


class RunWorkers:
    """The run's worker groups on its placement group: :meth:`start` starts every role's ranks (the
    colocated engines inside the policy ranks, separate engines in a group of their own) and returns
    the role handles; :meth:`stop` kills them all, and the engines they host with them."""

    def __init__(self, config: RLConfig, setup: RunSetup, *, gpu: bool) -> None:
        from rltrain.orchestrator.liveness import Liveness
        from rltrain.orchestrator.node_groups import reserve_node_groups
        from rltrain.orchestrator.placement import node_groups, run_placement
        from rltrain.orchestrator.worker_group import check_pools_fit

        self.config, self.model_dir, self.total_steps = config, setup.model_dir, setup.total_steps
        self.gpu = gpu
        self.pools = run_placement(config, gpu=gpu)
        self.layout = self.pools.rollout
        bundles = [b.resources() for b in self.pools.bundles]
        check_pools_fit(bundles, pool_sizes(config))
        self.pg = reserve_node_groups(
            bundles, node_groups(self.pools, config), timeout_s=config.trainer.timeouts.init_s
        )
        """The run's placement groups, one per node's share of a pool (:mod:`~rltrain.orchestrator.node_groups`)."""
        self.groups: list = []
        self.liveness = Liveness(config.trainer.timeouts.liveness_s)
        """One watch over every group's ranks: a frozen critic is found while the driver waits on the actor."""

    def placement_of(self, pool: str):
        """Where a role's ranks go (its :attr:`~rltrain.orchestrator.role_table.RoleSpec.pool`): its
        pool's bundles, an equal share of each per role there; ``rollout``: one separate engine's
        bundle each, after the trainer's."""
        from rltrain.orchestrator.worker_group import Placement

        if pool == "rollout":
            bundle = self.layout.engine_bundles[0]
            return Placement(
                self.pg,
                first_bundle=self.layout.first_engine_bundle,
                num_cpus=1.0,
                num_gpus=float(bundle.num_gpus),
                device_resource=bundle.device_resource,
            )
        placed = self.pools.pool_of(pool)
        bundle = self.pools.bundles[placed.first_bundle]
        return Placement(
            self.pg,
            first_bundle=placed.first_bundle,
            num_cpus=placed.share,
            num_gpus=placed.share if bundle.num_gpus else 0.0,
            device_resource=bundle.device_resource,
        )

    def _launch(self, role: str, cls: type, size: int, where, **kwargs):
        """Start ``size`` ranks of ``cls(config, model_dir, **kwargs)`` building (killed by
        :meth:`stop`); :meth:`RayWorkerGroup.started` waits for them."""
        from rltrain.orchestrator.worker_group import RayWorkerGroup

        group = RayWorkerGroup(
            role,
            cls,
            world_size=size,
            placement=where,
            args=(self.config, self.model_dir),
            kwargs=kwargs,
            timeouts=self.config.trainer.timeouts,
            wait=False,
            liveness=self.liveness,
        )
        self.groups.append(group)
        return group

    def start(self):
        """Start every role the run has (the role table, :mod:`~rltrain.orchestrator.role_table`);
        the :class:`~rltrain.trainer.driver.Roles` over them.

        On CPU every role's ranks build at once (imports, model building and the engine's start
        overlap: 25.5 s -> 18.4 s on the quickstart); on GPUs one role after the other, the policy
        with its engine first, so that an engine sizing its KV cache by the device memory left
        does not race another role's allocations."""
        from rltrain.orchestrator.role_table import run_roles

        run = self.role_run()
        launches = [(spec, spec.world(run)) for spec in run_roles(run)]
        groups = {}
        for together in [[launch] for launch in launches] if self.gpu else [launches]:
            with roles_stage([(spec.title, size) for spec, size in together]):
                for spec, size in together:
                    groups[spec.name] = self._launch(
                        spec.name, spec.worker_class(), size, self.placement_of(spec.pool), **spec.kwargs(run)
                    )
                for spec, _ in together:
                    groups[spec.name].started()
        self.record_placement(groups)
        if "rollout" in groups:
            self.connect_engines(groups["actor_rollout_ref"], groups["rollout"])
        return self.handles(groups)

    def record_placement(self, groups: dict) -> None:
        """Log which node each role's ranks run on and write it to ``placement.json`` in the run
        directory (:func:`~rltrain.orchestrator.node_groups.placement_record`; rewritten at a restart)."""
        import json

        from rltrain.orchestrator.node_groups import placement_lines, placement_record

        record = placement_record(groups, self.layout.engine_ranks)
        for line in placement_lines(record):
            log.info(line)
        run_dir = self.config.run_dir()
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / "placement.json.tmp"
        tmp.write_text(json.dumps(record, indent=1), encoding="utf-8")
        tmp.replace(run_dir / "placement.json")

    def role_run(self):
        """What the role table's functions read of this run."""
        from rltrain.orchestrator.role_table import RoleRun
        from rltrain.trainer.algorithms import build_algorithm

        needs = build_algorithm(self.config).needs
        return RoleRun(self.config, needs, self.layout, self.total_steps)

    def connect_engines(self, policy_group, rollout_group) -> None:
        """Join the separate engines and the actor's ranks that send to them (all of them; rank 0
        with ``rollout.weight_sync.transport: broadcast``) in the weights' group."""
        world, num_engines = self.config.cluster.world_size(), self.layout.num_engines
        senders = 1 if self.config.rollout.weight_sync.transport == "broadcast" else world
        address = policy_group.free_address()
        joining = rollout_group.submit("connect_weight_sync", address, num_engines, senders)
        policy_group.call("connect_weight_sync", address, num_engines, senders)
        rollout_group.wait("connect_weight_sync", joining)

    def handles(self, groups: dict):
        """The driver-side handles over the started groups: each row's handle fills its
        :class:`~rltrain.trainer.driver.Roles` field (:attr:`RoleSpec.handle`)."""
        from rltrain.orchestrator.role_table import run_roles
        from rltrain.trainer.driver import Roles
        from rltrain.trainer.roles import CriticRole, PolicyRole, RewardModelRole

        trainer = self.config.trainer
        build = {
            "policy": lambda group: PolicyRole(
                group, placement=self.layout, separate=groups.get("rollout"), trainer=trainer
            ),
            "critic": lambda group: CriticRole(group, trainer=trainer, overlap=self.critic_overlaps()),
            "reward_model": lambda group: RewardModelRole(group, trainer=trainer),
        }
        specs = [spec for spec in run_roles(self.role_run()) if spec.handle is not None]
        return Roles(**{spec.handle: build[spec.handle](groups[spec.name]) for spec in specs})

    def critic_overlaps(self) -> bool:
        """``trainer.overlap_critic``; null: on a CPU-only cluster, or with the critic on devices of
        its own (a pool apart from the actor's)."""
        chosen = self.config.trainer.overlap_critic
        if chosen is not None:
            return chosen
        return not self.gpu or self.pools.pool_of("critic") is not self.pools.pool_of("actor")

    def restart(self):
        """Kill every group and start them again (a worker died or stopped answering), once Ray has
        placed the run's bundles again (after a node's loss: elsewhere, or on a node that joins, within
        ``trainer.timeouts.init_s``)."""
        self.stop()
        self.pg.wait_placed(self.config.trainer.timeouts.init_s, again=True)
        return self.start()

    def stop(self) -> None:
        for group in self.groups:
            group.kill()
        self.groups = []

    def release(self) -> None:
        """:meth:`stop`, and free the placement groups."""
        self.stop()
        self.pg.remove()
