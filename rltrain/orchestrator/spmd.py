"""The torchrun mode: every rank runs the same driver loop over roles hosted in its own process.

``torchrun --nproc_per_node N -m rltrain.train RECIPE`` starts N processes; each builds its share of
the actor, reference, critic and a rollout engine (roles share one parallel context: Megatron keeps
one parallel state per process, so the critic must use the actor's layout). The role handles of the
Ray mode run unchanged over :class:`SPMDGroup`, which calls the local worker and all-gathers the
results, so every rank holds the full step batch and takes the same decisions. Only rank 0 writes
metrics and the run-level checkpoint structure; role checkpoints are collective as in the Ray mode.
A failure on any rank is raised on every rank as :class:`WorkerError` naming role, rank and method;
a rank's :class:`~rltrain.errors.RunStopped` (divergence, non-finite weights) as itself, its one line
prefixed with the role and rank. SIGTERM/SIGUSR1 on any rank stop every rank after the same step,
saved (:mod:`~rltrain.trainer.preemption`; the ranks agree after each step). There are no
restarts in this mode (``trainer.max_restarts`` is refused): torchrun's ``--max-restarts`` restarts
every rank, and ``resume_mode: auto`` continues from the last checkpoint.
"""

from __future__ import annotations

import logging
import os
import traceback
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from rltrain.config import ConfigError, RLConfig
from rltrain.config.pools import GLOBAL_POOL
from rltrain.errors import RunStopped
from rltrain.orchestrator.role_table import RoleRun, run_roles
from rltrain.trainer.recovery import WorkerError

log = logging.getLogger(__name__)


class SPMDGroup:
    """This process's rank of a role; ``call`` results are gathered from all ranks, in rank order."""

    def __init__(self, role: str, worker: Any) -> None:
        self.role = role
        self.worker = worker
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._run(method, args, kwargs)

    def call_each(self, method: str, per_rank_args: list[tuple], **kwargs: Any) -> list[Any]:
        if len(per_rank_args) != self.world_size:
            raise ValueError(
                f"{self.role}.{method}: {len(per_rank_args)} argument sets for {self.world_size} ranks"
            )
        return self._run(method, per_rank_args[self.rank], kwargs)

    def _run(self, method: str, args: tuple, kwargs: dict) -> list[Any]:
        try:
            outcome = (True, getattr(self.worker, method)(*args, **kwargs))
        except RunStopped as err:  # its one line says it all: travels as itself
            outcome = (False, err)
        except Exception as err:  # every rank learns of it below, naming this rank
            outcome = (
                False,
                f"{type(err).__name__}: {err}\n--- worker traceback ---\n{traceback.format_exc()}",
            )
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, outcome)
        for rank, (ok, value) in enumerate(gathered):
            if not ok:
                if isinstance(value, RunStopped):
                    raise type(value)(f"{self.role} rank {rank}: {value}")
                raise WorkerError(self.role, rank, method, value)
        return [value for _, value in gathered]


def agree_on_stop(signum: int) -> int:
    """The stop signal every rank settles on: the largest any rank received (0: none)."""
    import torch

    value = torch.tensor([signum], dtype=torch.int64, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def check_world(config: RLConfig) -> None:
    """Refuse (:class:`~rltrain.config.ConfigError`, one line) what the torchrun mode cannot run."""
    world = int(os.environ["WORLD_SIZE"])
    problems = []
    if world != config.cluster.world_size():
        problems.append(
            f"torchrun started {world} processes but cluster.nnodes × cluster.n_gpus_per_node = "
            f"{config.cluster.nnodes}×{config.cluster.n_gpus_per_node} = {config.cluster.world_size()}"
        )
    if config.rollout.mode != "colocated":
        problems.append(
            "torchrun mode runs each rank's engine beside its trainer: rollout.mode must be colocated"
        )
    if config.trainer.max_restarts:
        problems.append(
            f"trainer.max_restarts={config.trainer.max_restarts} needs the Ray mode; under torchrun use "
            "torchrun --max-restarts (resume_mode auto continues from the last checkpoint)"
        )
    if config.critic_enabled() and config.critic.parallel != config.actor.parallel:
        problems.append(
            "torchrun mode hosts actor and critic in one process: critic.parallel must equal actor.parallel "
            f"({config.critic.parallel} != {config.actor.parallel}); use the Ray mode for different layouts"
        )
    for role in ("critic", "reward_model"):
        if (pool := getattr(config.cluster.role_pool, role)) != GLOBAL_POOL:
            problems.append(
                f"cluster.role_pool.{role}={pool}: torchrun mode runs every role on the launcher's "
                "processes; resource pools need the Ray mode"
            )
    for spec in run_roles(role_run(config, total_steps=0)):
        if not spec.torchrun and spec.name != "rollout":  # separate engines: refused above
            problems.append(
                _NOT_HOSTED.get(spec.name, f"the run has a {spec.name} role")
                + f": the {spec.name.replace('_', ' ')} runs on workers of its own, which the Ray mode starts "
                "(rltrain train / ray job submit); torchrun mode has none"
            )
    if problems:
        raise ConfigError(problems)


_NOT_HOSTED = {"reward_model": "reward.reward_model.enable=true"}
"""What the user switched on to get a role the torchrun mode cannot host (its key and value)."""


def role_run(config: RLConfig, *, total_steps: int):
    """What the role table reads of this run (:class:`~rltrain.orchestrator.role_table.RoleRun`)."""
    import torch

    from rltrain.orchestrator.placement import rollout_placement
    from rltrain.trainer.algorithms import build_algorithm

    layout = rollout_placement(config, gpu=torch.cuda.is_available())
    return RoleRun(config, build_algorithm(config).needs, layout, total_steps)


def train_spmd(config: RLConfig) -> int:
    """Run ``config`` on this torchrun rank; returns the last step."""
    import torch

    from rltrain.orchestrator.run_workers import role_stage
    from rltrain.trainer.checkpoints import RunCheckpoints
    from rltrain.trainer.driver import Roles
    from rltrain.trainer.preemption import StopSignals
    from rltrain.trainer.roles import CriticRole, PolicyRole
    from rltrain.trainer.run import prepare_run, run_driver

    check_world(config)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend="nccl" if torch.cuda.is_available() else "gloo",
        timeout=timedelta(seconds=config.trainer.timeouts.collective_s),
    )
    rank = dist.get_rank()
    # Rank 0 resolves (and may build) the model and writes the config; the others then read its cache.
    setup = prepare_run(config, write_config=True) if rank == 0 else None
    dist.barrier()
    setup = setup or prepare_run(config, write_config=False)
    run, world = role_run(config, total_steps=setup.total_steps), dist.get_world_size()
    hosted: dict[str, Any] = {}
    for spec in run_roles(run):  # check_world refused the roles this mode cannot host
        with role_stage(spec.name, world):
            ctx = hosted["actor_rollout_ref"].ctx if hosted else None  # one parallel state per process
            hosted[spec.name] = spec.worker_class()(
                config, setup.model_dir, None, **spec.kwargs(run), ctx=ctx
            )
    worker, critic_worker = hosted["actor_rollout_ref"], hosted.get("critic")
    critic = None
    if critic_worker is not None:
        critic = CriticRole(SPMDGroup("critic", critic_worker), trainer=config.trainer)
    policy = PolicyRole(SPMDGroup("actor_rollout_ref", worker), placement=run.layout, trainer=config.trainer)
    checkpoints = RunCheckpoints(
        config.run_dir() / "checkpoints",
        keep=config.trainer.checkpoint.max_ckpt_to_keep,
        is_writer=rank == 0,
        barrier=dist.barrier,
    )
    try:
        with StopSignals(agree=agree_on_stop).installed() as stop:
            return run_driver(
                config,
                setup,
                Roles(policy=policy, critic=critic),
                checkpoints=checkpoints,
                is_logger=rank == 0,
                stop=stop,
            )
    finally:
        worker.shutdown()  # the engine first: it must not outlive the process group
        if dist.is_initialized():  # an in-process vLLM engine may have torn the default group down
            dist.destroy_process_group()
