"""``rltrain train`` under Ray: resolve the model and data, place the roles, run the driver.

Ray (:mod:`~rltrain.orchestrator.ray_connect`, checked before the model and the prompts are
prepared): joins the cluster named by ``cluster.ray_address`` or ``RAY_ADDRESS`` (the cluster a
``ray job submit`` runs in), else the one ``ray start`` recorded on this machine, else starts a
private one with ``cluster.num_cpus`` CPUs; never another process's private instance. Every call to
the workers is bounded by ``trainer.timeouts``.
Placement and the worker groups: :mod:`~rltrain.orchestrator.run_workers`. Nothing of the run
outlives the driver (:mod:`~rltrain.orchestrator.reaper`).
"""

from __future__ import annotations

import logging

from rltrain.config import RLConfig
from rltrain.orchestrator.ray_connect import connect_ray, resolve_ray

log = logging.getLogger(__name__)


def train(config: RLConfig) -> int:
    """Run ``config`` to the end; returns the last step. Raises
    :class:`~rltrain.trainer.preemption.Preempted` when a stop signal ended it early, saved."""
    import ray

    from rltrain.orchestrator.reaper import reaped_run
    from rltrain.trainer.preemption import StopSignals
    from rltrain.trainer.run import prepare_run, run_driver

    ray_target = None if ray.is_initialized() else resolve_ray(config)  # a refusing cluster: fail now
    setup = prepare_run(config)
    # Every process started from here on (a private Ray's daemons and workers, engines, sandboxes) is
    # killed when the driver ends, by any means: nothing of the run outlives it by more than a moment.
    from rltrain.orchestrator.run_workers import RunWorkers

    with reaped_run():
        started_ray = connect_ray(config, ray_target)
        gpu = config.cluster.backend == "nccl" or (config.cluster.backend == "auto" and _cuda())
        workers = None
        # After connect_ray: a Ray it started put its own SIGTERM handler in (it would exit at once).
        with StopSignals().installed() as stop:
            try:
                workers = RunWorkers(config, setup, gpu=gpu)
                return run_driver(
                    config,
                    setup,
                    workers.start,
                    rewards=_reward_pool(config),
                    stop=stop,
                    restart_roles=workers.restart,
                )
            finally:
                if workers is not None:
                    workers.release()
                if started_ray:
                    ray.shutdown()


def _reward_pool(config: RLConfig):
    """Rewards scored in Ray CPU tasks when ``reward.num_workers`` > 0, else None (the driver scores)."""
    if not config.reward.num_workers:
        return None
    from rltrain.orchestrator.reward_workers import RayRewardPool
    from rltrain.rewards import RewardManager

    manager = RewardManager.from_config(config.reward)
    return RayRewardPool(manager, config.reward.num_workers, timeout_s=config.trainer.timeouts.reward_s)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
