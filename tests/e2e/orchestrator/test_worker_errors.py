"""A failure inside a Ray worker surfaces in the driver naming the role, the rank and the method."""

import os

import pytest
from ray.util.placement_group import placement_group, remove_placement_group

from rltrain.orchestrator.worker_group import Placement, RayWorkerGroup, WorkerError

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


@pytest.fixture
def placement(local_ray):
    pg = placement_group([{"CPU": 1}, {"CPU": 1}])
    local_ray.get(pg.ready())
    yield Placement(pg, num_cpus=0.25)
    remove_placement_group(pg)


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
    with pytest.raises(WorkerError, match=r"^reward rank 1: die failed: the worker process died"):
        group.call("die")
    group.kill()
