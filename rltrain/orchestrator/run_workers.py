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

from typing import TYPE_CHECKING

from rltrain.config import RLConfig
from rltrain.logging.console import stage

if TYPE_CHECKING:
    from rltrain.trainer.run import RunSetup

_ROLE_TITLES = {
    "actor_rollout_ref": "the actor, reference and rollout engine",
    "rollout": "the rollout engines",
    "critic": "the critic",
    "reward_model": "the reward model",
}
"""What the status line calls each role while its workers start."""


def roles_stage(roles: list[tuple[str, int]]):
    """The status lines around starting roles at once: ``(role, num_ranks)`` each."""
    named = [f"{_ROLE_TITLES.get(role, role)} ({n} rank{'s' if n > 1 else ''})" for role, n in roles]
    return stage("starting " + (f"{', '.join(named[:-1])} and {named[-1]}" if len(named) > 1 else named[0]))


def role_stage(role: str, num_ranks: int):
    """The status lines around starting ``num_ranks`` ranks of ``role``."""
    return roles_stage([(role, num_ranks)])


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
        from rltrain.orchestrator.placement import run_placement
        from rltrain.orchestrator.worker_group import check_pools_fit, reserve_bundles

        self.config, self.model_dir, self.total_steps = config, setup.model_dir, setup.total_steps
        self.gpu = gpu
        self.pools = run_placement(config, gpu=gpu)
        self.layout = self.pools.rollout
        bundles = [b.resources() for b in self.pools.bundles]
        check_pools_fit(bundles, pool_sizes(config))
        self.pg = reserve_bundles(bundles, timeout_s=config.trainer.timeouts.init_s)
        self.groups: list = []
        self.liveness = Liveness(config.trainer.timeouts.liveness_s)
        """One watch over every group's ranks: a frozen critic is found while the driver waits on the actor."""

    def placement_of(self, role: str):
        """Where ``role``'s ranks go: its pool's bundles, an equal share of each per role there."""
        from rltrain.orchestrator.worker_group import Placement

        pool = self.pools.pool_of(role)
        bundle = self.pools.bundles[pool.first_bundle]
        return Placement(
            self.pg,
            first_bundle=pool.first_bundle,
            num_cpus=pool.share,
            num_gpus=pool.share if bundle.num_gpus else 0.0,
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
        """Start every role; the :class:`~rltrain.trainer.driver.Roles` over them.

        On CPU every role's ranks build at once (imports, model building and the engine's start
        overlap: 25.5 s -> 18.4 s on the quickstart); on GPUs one role after the other, the policy
        with its engine first, so that an engine sizing its KV cache by the device memory left
        does not race another role's allocations."""
        from rltrain.orchestrator.worker_group import Placement
        from rltrain.trainer.driver import Roles
        from rltrain.trainer.roles import CriticRole, PolicyRole, RewardModelRole
        from rltrain.workers.model_workers import CriticWorker, PolicyWorker, RewardModelWorker
        from rltrain.workers.rollout_worker import RolloutWorker

        config, layout, world = self.config, self.layout, self.config.cluster.world_size()
        steps = {"total_steps": self.total_steps}
        launches = [
            (
                "actor_rollout_ref",
                PolicyWorker,
                world,
                self.placement_of("actor"),
                {**steps, "placement": layout},
            )
        ]
        if layout.separate:
            engine_bundle = layout.engine_bundles[0]
            engine_placement = Placement(
                self.pg,
                first_bundle=layout.first_engine_bundle,
                num_cpus=1.0,
                num_gpus=float(engine_bundle.num_gpus),
                device_resource=engine_bundle.device_resource,
            )
            launches.append(("rollout", RolloutWorker, layout.num_engines, engine_placement, {}))
        if config.critic_enabled():
            launches.append(
                ("critic", CriticWorker, config.role_world("critic"), self.placement_of("critic"), steps)
            )
        if config.reward.reward_model.enable:
            rm_world = config.role_world("reward_model")
            launches.append(
                ("reward_model", RewardModelWorker, rm_world, self.placement_of("reward_model"), {})
            )
        groups = {}
        for together in [[launch] for launch in launches] if self.gpu else [launches]:
            with roles_stage([(role, size) for role, _, size, _, _ in together]):
                for role, cls, size, where, kwargs in together:
                    groups[role] = self._launch(role, cls, size, where, **kwargs)
                for role, *_ in together:
                    groups[role].started()
        policy_group, rollout_group = groups["actor_rollout_ref"], groups.get("rollout")
        if rollout_group is not None:
            num_engines = layout.num_engines
            address = policy_group.free_address()
            joining = rollout_group.submit("connect_weight_sync", address, num_engines)
            policy_group.call_each(
                "connect_weight_sync", [(address if r == 0 else None, num_engines) for r in range(world)]
            )
            rollout_group.wait("connect_weight_sync", joining)
        critic = reward_model = None
        if "critic" in groups:
            critic = CriticRole(groups["critic"], trainer=config.trainer, overlap=self.critic_overlaps())
        if "reward_model" in groups:
            reward_model = RewardModelRole(groups["reward_model"], trainer=config.trainer)
        return Roles(
            policy=PolicyRole(policy_group, placement=layout, separate=rollout_group, trainer=config.trainer),
            critic=critic,
            reward_model=reward_model,
        )

    def critic_overlaps(self) -> bool:
        """``trainer.overlap_critic``; null: on a CPU-only cluster, or with the critic on devices of
        its own (a pool apart from the actor's)."""
        chosen = self.config.trainer.overlap_critic
        if chosen is not None:
            return chosen
        return not self.gpu or self.pools.pool_of("critic") is not self.pools.pool_of("actor")

    def restart(self):
        """Kill every group and start them again (a worker died or stopped answering)."""
        self.stop()
        return self.start()

    def stop(self) -> None:
        for group in self.groups:
            group.kill()
        self.groups = []

    def release(self) -> None:
        """:meth:`stop`, and free the placement group."""
        import ray

        self.stop()
        ray.util.remove_placement_group(self.pg)
