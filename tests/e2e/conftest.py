"""A local Ray instance shared by the e2e tests (started once, 4 logical CPUs on the 2 cores, and 4 of
a custom resource standing in for GPUs).

Subprocesses that should join it get its address in ``RAY_ADDRESS`` (``ray_env``), so they never
pick up some other cluster through ``address="auto"``. ``worker_groups`` records every Ray worker
group a test's in-process run starts (their roles and process ids, for the fault tests).
"""

import os

import pytest

# the shared comparison helper's asserts explain a difference, as a test module's do
pytest.register_assert_rewrite("tests.e2e.wall_clock")

STAND_IN_GPU = "stand_in_gpu"
"""A custom resource of the shared Ray that stands in for GPUs (``cluster.device_resource``)."""


@pytest.fixture(scope="session")
def local_ray():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local",
            num_cpus=4,  # logical: the reward-model e2e (actor 1, critic 1, reward model 2 ranks) takes all 4
            resources={STAND_IN_GPU: 4},
            include_dashboard=False,
            log_to_driver=False,
        )
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture
def ray_env(local_ray):
    address = local_ray.get_runtime_context().gcs_address
    return {**os.environ, "RAY_ADDRESS": address, "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def worker_groups(monkeypatch):
    from rltrain.orchestrator import worker_group

    groups = []
    original_started = worker_group.RayWorkerGroup.started

    def recording_started(self):
        built = bool(self.pids)
        original_started(self)
        if not built:  # in the order the run waits for them; their process ids known
            groups.append(self)
        return self

    monkeypatch.setattr(worker_group.RayWorkerGroup, "started", recording_started)
    return groups
