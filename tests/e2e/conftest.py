"""A local Ray instance shared by the e2e tests (started once, 2 CPUs).

Subprocesses that should join it get its address in ``RAY_ADDRESS`` (``ray_env``), so they never
pick up some other cluster through ``address="auto"``.
"""

import os

import pytest


@pytest.fixture(scope="session")
def local_ray():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture
def ray_env(local_ray):
    address = local_ray.get_runtime_context().gcs_address
    return {**os.environ, "RAY_ADDRESS": address, "PYTHONUNBUFFERED": "1"}
