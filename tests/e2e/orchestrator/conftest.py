"""A local Ray instance shared by the orchestrator tests (started once, 2 CPUs)."""

import pytest


@pytest.fixture(scope="session")
def local_ray():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
