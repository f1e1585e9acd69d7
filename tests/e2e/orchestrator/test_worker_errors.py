"""A failure inside a Ray worker surfaces in the driver naming the role, the rank and the method; so
do a worker process that died (one line, a WorkerLost) and one that stops answering (SIGSTOP), within
its timeout."""

import os
import re
import signal
import subprocess
import time

import pytest

from rltrain.config.trainer import TimeoutConfig
from rltrain.errors import DivergenceError, RunStopped
from rltrain.orchestrator.liveness import Liveness, WorkerUnresponsive
from rltrain.orchestrator.node_groups import reserve_node_groups
from rltrain.orchestrator.worker_group import (
    Placement,
    PlacementTimeout,
    RayWorkerGroup,
    WorkerDied,
    WorkerError,
    WorkerTimeout,
)
from rltrain.trainer.recovery import WorkerLost

pytestmark = pytest.mark.e2e


class RankedWorker:
    """A real worker object: records its rank; fails on purpose where a test asks it to."""

    def __init__(self, scale: int, info, *, fail_init_rank: int = -1) -> None:
        if info.rank == fail_init_rank:
            raise ValueError(f"cannot build on rank {info.rank}")
        self.rank, self.scale = info.rank, scale

    def times(self, x: int) -> int:
        return x * self.scale + self.rank

    def divide(self, x: int) -> float:
        return x / (self.rank - 1)  # rank 1 divides by zero

    def die(self) -> None:
        if self.rank == 1:
            os._exit(3)

    def pid(self) -> int:
        return os.getpid()

    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    def spin(self, seconds: float) -> int:
        """Pure Python work holding the interpreter (it hands the GIL over every few milliseconds)."""
        end, count = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            count += 1
        return self.rank

    def start_child(self) -> int:
        """A child process as an engine core would be (the rank's own process group)."""
        self.child = subprocess.Popen(["sleep", "120"])
        return self.child.pid

    def diverge(self) -> None:
        if self.rank == 1:
            raise DivergenceError("actor diverged: parameter w (rank 1) is not finite")


@pytest.fixture
def placement(local_ray):
    groups = reserve_node_groups([{"CPU": 1}, {"CPU": 1}], ((0, 2),), timeout_s=60)
    yield Placement(groups, num_cpus=0.25)
    groups.remove()


def ranked_group(placement, role: str, **timeouts: float) -> RayWorkerGroup:
    """Two ranks of :class:`RankedWorker` as ``role``, with these ``trainer.timeouts``."""
    return RayWorkerGroup(
        role, RankedWorker, world_size=2, placement=placement, args=(1,), timeouts=TimeoutConfig(**timeouts)
    )


def test_results_come_back_in_rank_order(placement):
    group = RayWorkerGroup("toy", RankedWorker, world_size=2, placement=placement, args=(10,))
    assert group.call("times", 3) == [30, 31]
    assert group.call_each("times", [(1,), (2,)]) == [10, 21]
    group.kill()


def test_exception_names_role_rank_method_and_cause(placement):
    group = RayWorkerGroup("critic", RankedWorker, world_size=2, placement=placement, args=(10,))
    with pytest.raises(WorkerError) as info:
        group.call("divide", 4)
    err = info.value
    assert (err.role, err.rank, err.method) == ("critic", 1, "divide")
    assert str(err).startswith("critic rank 1: divide failed: ZeroDivisionError: division by zero")
    assert "worker traceback" in str(err) and "return x / (self.rank - 1)" in str(err)
    group.kill()


def test_constructor_failure_and_dead_process_are_named(placement):
    with pytest.raises(
        WorkerError, match=r"^actor_rollout_ref rank 1: __init__ failed: ValueError: cannot build on rank 1"
    ):
        RayWorkerGroup(
            "actor_rollout_ref",
            RankedWorker,
            world_size=2,
            placement=placement,
            args=(1,),
            kwargs={"fail_init_rank": 1},
        )
    group = RayWorkerGroup("reward", RankedWorker, world_size=2, placement=placement, args=(1,))
    assert group.pids == group.call("pid")
    with pytest.raises(WorkerDied) as info:
        group.call("die")
    err = info.value
    assert isinstance(err, WorkerError) and isinstance(err, WorkerLost)
    # one line; what Ray says about the death is kept beside it (the run's log file gets it)
    assert str(err) == "reward rank 1: die failed: the worker process died (ActorDiedError)"
    assert (err.role, err.rank, err.method) == ("reward", 1, "die")
    assert err.detail.startswith("ActorDiedError: ")
    group.kill()


def test_a_stopped_worker_is_named_within_the_timeout(placement):
    """Rank 1 is stopped (SIGSTOP) in the middle of a call: the driver's wait ends at the method's
    bound with one line naming the role, that rank and the method; rank 0's answer came back."""
    group = ranked_group(placement, "critic", call_s=3.0)
    pid = group.call("pid")[1]
    try:
        calls = group.submit("nap", 0.5)
        time.sleep(0.2)
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerTimeout) as info:
            group.wait("nap", calls)
        waited = time.monotonic() - start
        assert 2.95 <= waited < 4.5, waited  # ray.wait may return a fraction of a millisecond early
        err = info.value
        assert isinstance(err, WorkerError) and isinstance(err, RunStopped) and isinstance(err, WorkerLost)
        assert (err.role, err.ranks, err.method) == ("critic", [1], "nap")
        assert str(err) == (
            "critic rank 1: nap did not finish within 3 s (trainer.timeouts.call_s): a worker stopped or "
            "hung, or waits in a collective for one that did"
        )
    finally:
        os.kill(pid, signal.SIGCONT)
        group.kill()


def test_a_workers_run_stop_arrives_as_itself_in_one_line(placement):
    group = RayWorkerGroup("actor_rollout_ref", RankedWorker, world_size=2, placement=placement, args=(1,))
    with pytest.raises(DivergenceError) as info:
        group.call("diverge")
    assert str(info.value) == "actor_rollout_ref rank 1: actor diverged: parameter w (rank 1) is not finite"
    group.kill()


def test_bundles_the_cluster_cannot_place_fail_naming_them(local_ray):
    """The second node's share (bundles 1..2) fits no node of the shared Ray (one node, 4 CPUs):
    named, with what the node has, and the first share's group is released too."""
    from ray.util import placement_group_table

    before = set(placement_group_table())
    with pytest.raises(PlacementTimeout) as info:
        reserve_node_groups([{"CPU": 1}, {"CPU": 3}, {"CPU": 3}], ((0, 1), (1, 2)), timeout_s=1.0)
    have = local_ray.cluster_resources()["CPU"]  # the shared Ray's (tests/e2e/conftest.py)
    assert str(info.value) == (
        "Ray could not place the run's bundles 1..2 [{'CPU': 3}, {'CPU': 3}] on one node within 1 s "
        f"(trainer.timeouts.init_s); the cluster's nodes have [{{'CPU': {have}}}] (other jobs may hold part of them)"
    )
    # both groups it made are removed (other tests' groups may still be going away meanwhile)
    made = [table for key, table in placement_group_table().items() if key not in before]
    assert [sorted(t["bundles"].values(), key=str) for t in made] in (
        [[{"CPU": 1.0}], [{"CPU": 3.0}, {"CPU": 3.0}]],
        [[{"CPU": 3.0}, {"CPU": 3.0}], [{"CPU": 1.0}]],
    ), made
    assert all(t["state"] == "REMOVED" for t in made), made


def process_state(pid: int) -> str:
    """The one-letter state in ``/proc/<pid>/stat`` (``T`` stopped, ``Z`` zombie, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0]


def test_a_stopped_worker_is_named_by_liveness_long_before_its_deadline(placement):
    """The call may take 600 s; rank 1's process is stopped (SIGSTOP) during it and named after
    ``liveness_s`` (3 s here) of silence, in one line naming the role, rank, pid and the call."""
    group = ranked_group(placement, "critic", call_s=600.0, liveness_s=3.0)
    pid = group.pids[1]
    try:
        calls = group.submit("nap", 60.0)
        time.sleep(0.5)
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerUnresponsive) as info:
            group.wait("nap", calls)
        waited = time.monotonic() - start
        assert 2.4 <= waited < 6.0, waited  # asked every 0.5 s: silent 3 s after the last answer
        err = info.value
        assert isinstance(err, RunStopped) and isinstance(err, WorkerLost)
        assert (err.role, err.rank, err.method) == ("critic", 1, "critic's nap")
        assert re.fullmatch(
            rf"critic rank 1: its process \(pid {pid}\) gave no sign of life for \d s "
            r"\(trainer\.timeouts\.liveness_s=3\): stopped, frozen or swapped out, while the driver waited "
            r"for critic's nap",
            str(err),
        ), str(err)
    finally:
        os.kill(pid, signal.SIGCONT)
        group.kill()


def test_busy_workers_keep_answering(placement):
    """A rank busy in Python (holding the interpreter between switches) or asleep for four times the
    liveness bound is not taken for frozen, on a node with many processes and a core to spare (a
    rank that walked /proc for its stopped children before answering took seconds to answer while
    its main thread held the interpreter: milliseconds of waiting for it per file read)."""
    others = [subprocess.Popen(["sleep", "120"]) for _ in range(200)]
    group = ranked_group(placement, "actor", call_s=60.0, liveness_s=1.0)
    try:
        assert group.call_each("spin", [(4.0,), (0.0,)]) == [0, 1]
        assert group.call_each("spin", [(0.0,), (4.0,)]) == [0, 1]
        assert group.call("nap", 4.0) == [0, 1]
    finally:
        group.kill()
        for other in others:
            other.kill()
            other.wait()


def test_a_stopped_child_process_is_named_and_killed_with_its_rank(placement):
    """An engine-like child of rank 0 is stopped: the rank still answers, saying so, and is named once
    the child has been stopped for ``liveness_s``; killing the group kills the stopped child too."""
    group = ranked_group(placement, "actor_rollout_ref", call_s=600.0, liveness_s=2.0)
    child = group.call("start_child")[0]
    try:
        os.kill(child, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerUnresponsive) as info:
            group.call("nap", 60.0)
        assert 1.9 <= time.monotonic() - start < 5.0
        assert re.fullmatch(
            rf"actor_rollout_ref rank 0: its child process {child} \(sleep\) has been stopped for \d s "
            r"\(trainer\.timeouts\.liveness_s=2\), while the driver waited for actor_rollout_ref's nap",
            str(info.value),
        ), str(info.value)
        assert process_state(child) == "T"
    finally:
        group.kill()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and process_state(child) != "Z":
        assert time.monotonic() < deadline, "the stopped child outlived its rank"
        time.sleep(0.05)


def test_one_watch_finds_a_frozen_rank_of_another_group(placement):
    """Groups sharing the run's :class:`Liveness`: the critic frozen while the driver waits on the actor."""
    liveness = Liveness(2.0)
    timeouts = TimeoutConfig(call_s=600.0, liveness_s=2.0)
    common = dict(world_size=1, placement=placement, args=(1,), timeouts=timeouts, liveness=liveness)
    actor = RayWorkerGroup("actor_rollout_ref", RankedWorker, **common)
    critic = RayWorkerGroup("critic", RankedWorker, **common)
    try:
        os.kill(critic.pids[0], signal.SIGSTOP)
        with pytest.raises(WorkerUnresponsive) as info:
            actor.call("nap", 60.0)
        assert (info.value.role, info.value.rank) == ("critic", 0)
        assert str(info.value).endswith("while the driver waited for actor_rollout_ref's nap")
    finally:
        os.kill(critic.pids[0], signal.SIGCONT)
        actor.kill()
        critic.kill()
