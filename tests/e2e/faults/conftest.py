"""The fault-injection tier: real runs of the quickstart's tiny model (3 steps, a short SFT warm-up,
short ``trainer.timeouts``) broken on purpose (a killed or stopped worker, SIGTERM of the driver, a
full filesystem), each compared with one uninterrupted run of the same settings (``reference``).

Runs started in this process (``entry.train``) use the local Ray of the e2e tests (``local_ray``);
a driver in a subprocess gets its address in ``RAY_ADDRESS`` or starts a private one. The folder is
put on ``sys.path`` so that ``fault_runs`` imports by name (the repository runs pytest with
``--import-mode=importlib``).
"""

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from fault_runs import RECIPE, STEPS, Reference, fault_overrides, metrics_of  # noqa: E402

from rltrain.config import load_config  # noqa: E402


@pytest.fixture(scope="session")
def fault_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fault_models")


@pytest.fixture(scope="session")
def reference(local_ray, fault_cache, tmp_path_factory) -> Reference:
    """The uninterrupted run."""
    from rltrain.orchestrator.entry import train

    config = load_config(RECIPE, fault_overrides(tmp_path_factory.mktemp("reference"), fault_cache))
    assert train(config) == STEPS
    return Reference(metrics_of(config.run_dir()), config.run_dir())
