"""Liveness of the run's worker processes, apart from the progress deadlines of ``trainer.timeouts``.

A step's deadlines must allow for long-tail generations and slow updates (minutes to an hour), so
they cannot tell a frozen process quickly. While the driver waits for any call, every rank of every
watched group is asked, every few seconds, whether it lives: the question runs on a thread of its own
in the rank's process (Ray's ``liveness`` concurrency group), so a rank answers whatever its main
thread is doing, and says which of its child processes (an engine core, the engine's workers) are
stopped. A rank that leaves a question unanswered for ``trainer.timeouts.liveness_s`` (its process
stopped, frozen or swapped out, or its node gone) or that reports a child stopped for that long
raises :class:`WorkerUnresponsive`, one line naming the role, rank, process and the call the driver
was waiting for, a :class:`~rltrain.trainer.recovery.WorkerLost` that ``trainer.max_restarts``
recovers from.

A rank is watched from its first answer on (a rank that never answers is the ``init_s`` deadline's
business); a process that died is not this module's business either (its calls fail at once with
Ray's own error). Imports Ray lazily: the functions a rank runs need only psutil.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from rltrain.errors import RunStopped
from rltrain.trainer.recovery import WorkerLost

STOPPED_STATES = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


def stopped_children() -> list[tuple[int, str]]:
    """``(pid, name)`` of this process's descendants that are stopped (SIGSTOP, a tracer)."""
    stopped = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() in STOPPED_STATES:
                stopped.append((child.pid, child.name()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone meanwhile, or not ours to read
            continue
    return stopped


class ChildWatch:
    """A rank's answer to the liveness question: the stopped descendants found by the latest walk of
    /proc, which runs on a thread of its own, one walk per question.

    The answer must not wait for the walk: every file it reads hands the interpreter over, and while
    the rank's main thread holds the interpreter (pure Python work) each hand-back waits a switch
    interval, so a walk over a node's few hundred processes took seconds (2 s for 80 processes on
    two cores) and a busy rank was taken for frozen. A child stopped is therefore seen one walk late,
    well inside ``liveness_s``."""

    def __init__(self, walk: Callable[[], list[tuple[int, str]]] = stopped_children) -> None:
        self._walk = walk
        self._latest: list[tuple[int, str]] = []
        self._wanted = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rltrain-child-watch", daemon=True)
        self._thread.start()

    def answer(self) -> list[tuple[int, str]]:
        """The latest walk's stopped children; asks for a new walk (the next answer has it)."""
        self._wanted.set()
        return self._latest

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            try:
                self._latest = self._walk()
            except Exception:  # a walk that failed says nothing stopped; the next one retries
                self._latest = []


def kill_descendants() -> None:
    """SIGKILL every process below this one."""
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


class WorkerUnresponsive(RunStopped, WorkerLost):
    """A rank's process (or a child of it) gave no sign of life for ``trainer.timeouts.liveness_s``."""

    def __init__(self, role: str, rank: int, method: str, *, cause: str) -> None:
        self.role, self.rank, self.method, self.cause = role, rank, method, cause
        super().__init__(f"{role} rank {rank}: {cause}, while the driver waited for {method}")


@dataclass
class _Rank:
    role: str
    rank: int
    host: Any
    """The rank's Ray actor (``_RankHost``)."""
    pid: int | None = None
    asked: Any = None
    """The question in flight (an ObjectRef), or None."""
    asked_at: float = 0.0
    answered: bool = False
    """Whether it ever answered: only then is it watched."""
    gone: bool = False
    """Its process died (its calls say so themselves)."""
    stopped_since: dict[int, tuple[str, float]] = field(default_factory=dict)
    """Child pid -> (name, when it was first seen stopped)."""


class Liveness:
    """Asks every watched rank whether it lives and raises :class:`WorkerUnresponsive` for one that
    does not answer (or keeps a child stopped) for ``timeout_s``. ``timeout_s`` 0 turns it off."""

    def __init__(self, timeout_s: float, *, probe_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.probe_s = probe_s if probe_s is not None else min(5.0, max(timeout_s / 6, 0.1))
        """How often a rank is asked (and how long the driver waits for a call between checks)."""
        self._ranks: list[_Rank] = []
        self._nodes: dict[int, tuple[str, int, Any, tuple[str, str]]] = {}
        """id(host) -> (role, rank, host, (node id, node address)) of every started rank (watched or not)."""

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def watch(self, role: str, hosts: list) -> None:
        """Watch ``hosts[r]`` as rank r of ``role``; asks each at once."""
        if not self.enabled:
            return
        now = time.monotonic()
        for rank, host in enumerate(hosts):
            entry = _Rank(role, rank, host)
            self._ask(entry, now)
            self._ranks.append(entry)

    def set_pids(self, hosts: list, pids: list[int]) -> None:
        """Name ``hosts[r]``'s process ``pids[r]`` in what is said of it."""
        pid_of = {id(host): pid for host, pid in zip(hosts, pids)}
        for entry in self._ranks:
            entry.pid = pid_of.get(id(entry.host), entry.pid)

    def set_nodes(self, role: str, hosts: list, nodes: list[tuple[str, str]]) -> None:
        """``hosts[r]``, rank r of ``role``, runs on the Ray node ``nodes[r]`` (id, address)."""
        for rank, (host, node) in enumerate(zip(hosts, nodes)):
            self._nodes[id(host)] = (role, rank, host, node)

    def lost_node(self, role: str, rank: int) -> str:
        """When the node of ``role`` rank ``rank`` is gone: that node and every rank of the run on it
        (``its node 1f3a9c0b (10.0.0.5) is lost, and with it rollout rank 0``); else empty."""
        from rltrain.orchestrator.node_groups import node_gone

        node = next((n for r, k, _, n in self._nodes.values() if (r, k) == (role, rank)), None)
        if node is None or not node_gone(node[0]):
            return ""
        on_it = [f"{r} rank {k}" for r, k, _, n in self._nodes.values() if n[0] == node[0]]
        return f"its node {node[0][:8]} ({node[1]}) is lost, and with it {', '.join(on_it)}"

    def dead_rank(self, *, timeout_s: float = 5.0) -> tuple[str, int, BaseException] | None:
        """A started rank whose process is gone, ``(role, rank, Ray's error)``, or None: asked when a
        rank's collective failed, which is how a peer's death (or its node's) first shows."""
        import ray

        asked = {host.alive.remote(): (role, rank) for role, rank, host, _ in self._nodes.values()}
        done, _ = ray.wait(list(asked), num_returns=len(asked), timeout=timeout_s)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as err:
                return (*asked[ref], err)
            except ray.exceptions.RayError:
                continue
        return None

    def forget(self, hosts: list) -> None:
        self._ranks = [entry for entry in self._ranks if not any(entry.host is h for h in hosts)]
        for host in hosts:
            self._nodes.pop(id(host), None)

    def check(self, method: str) -> None:
        """Collect the answers, ask again those due, raise for a rank silent or stopped too long
        (``method``: the call the driver is waiting for, named in the error)."""
        if not self.enabled or not self._ranks:
            return
        import ray

        now = time.monotonic()
        asked = {entry.asked: entry for entry in self._ranks if entry.asked is not None}
        if asked:
            done, _ = ray.wait(list(asked), num_returns=len(asked), timeout=0)
            for ref in done:
                entry = asked[ref]
                entry.asked = None
                try:
                    stopped = ray.get(ref)
                except ray.exceptions.RayActorError:
                    entry.gone = True  # died: the waited-for call reports it
                    continue
                except ray.exceptions.RayError:
                    stopped = []  # the question failed inside the rank: it lives all the same
                entry.answered = True
                self._note_stopped(entry, stopped, now)
        for entry in self._ranks:
            if entry.gone:
                continue
            if entry.asked is not None:
                silent = now - entry.asked_at
                if entry.answered and silent >= self.timeout_s:
                    raise WorkerUnresponsive(
                        entry.role,
                        entry.rank,
                        method,
                        cause=f"its process{_pid(entry.pid)} gave no sign of life for {silent:.0f} s "
                        f"(trainer.timeouts.liveness_s={self.timeout_s:g}): stopped, frozen or swapped out",
                    )
            elif now - entry.asked_at >= self.probe_s:
                self._ask(entry, now)
            for child, (name, since) in entry.stopped_since.items():
                if now - since >= self.timeout_s:
                    raise WorkerUnresponsive(
                        entry.role,
                        entry.rank,
                        method,
                        cause=f"its child process {child} ({name}) has been stopped for {now - since:.0f} s "
                        f"(trainer.timeouts.liveness_s={self.timeout_s:g})",
                    )

    @staticmethod
    def _ask(entry: _Rank, now: float) -> None:
        entry.asked, entry.asked_at = entry.host.alive.remote(), now

    @staticmethod
    def _note_stopped(entry: _Rank, stopped: list[tuple[int, str]], now: float) -> None:
        current = {pid: name for pid, name in stopped}
        entry.stopped_since = {
            pid: entry.stopped_since.get(pid, (name, now)) for pid, name in current.items()
        }


def _pid(pid: int | None) -> str:
    return "" if pid is None else f" (pid {pid})"
