"""The quickstart's PPO across the nodes of a real multi-node Ray cluster on this machine
(``conftest.py``: node ``a`` with two stand-in devices, node ``b`` with one), each run started as a
user starts one on a cluster (``python -m rltrain.train`` with ``RAY_ADDRESS``) and compared with
the same run on the one-node local Ray of the other e2e tests: the metrics are equal in every key
but wall-clock times (CPU runs are deterministic), and the placement the run wrote
(``placement.json``: each rank's node and process, each engine's node) is the one the layout asks
for.

- the actor at TP=2 fills node ``a``; its separate engine runs on node ``b`` and gets every weight
  update by broadcast across the nodes;
- colocated across two nodes (``cluster.nnodes=2``, one device each): each node holds its own actor,
  critic and engine ranks (one device of ``a`` is held by another reservation, as a busy cluster's).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rltrain.config import load_config
from rltrain.logging.plot import read_metrics
from tests.e2e.conftest import STAND_IN_GPU
from tests.e2e.wall_clock import WALL_CLOCK

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "quickstart_cpu.yaml"
STEPS = 3
RUN_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("model_cache")


def run_overrides(run_root: Path, cache: Path, *extra: str) -> list[str]:
    return [
        f"trainer.default_local_dir={run_root}",
        f"model.cache_dir={cache}",
        f"trainer.total_training_steps={STEPS}",
        f"cluster.device_resource={STAND_IN_GPU}",
        "critic.warmup_steps=0",
        "trainer.save_freq=0",
        "trainer.test_freq=0",
        "trainer.logger=[jsonl]",
        *extra,
    ]


def one_node_and_cluster_runs(
    tmp_path: Path, cache: Path, ray_nodes, *layout: str
) -> tuple[list, list, dict]:
    """The metrics of ``layout`` on the local one-node Ray (in this process) and on the multi-node
    cluster (a driver process of its own), and the cluster run's ``placement.json``."""
    from rltrain.orchestrator.entry import train

    one = load_config(RECIPE, run_overrides(tmp_path / "one_node", cache, *layout))
    assert train(one) == STEPS
    many = load_config(RECIPE, run_overrides(tmp_path / "nodes", cache, *layout))
    driver = subprocess.run(
        [
            sys.executable,
            "-m",
            "rltrain.train",
            str(RECIPE),
            *run_overrides(tmp_path / "nodes", cache, *layout),
        ],
        cwd=ROOT,
        env=ray_nodes.env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-3000:]
    placement = json.loads((many.run_dir() / "placement.json").read_text())
    return read_metrics(one.run_dir()), read_metrics(many.run_dir()), placement


def assert_equal_but_wall_clock(one: list[dict], many: list[dict]) -> None:
    assert [r["step"] for r in one] == [r["step"] for r in many]
    for a, b in zip(one, many):
        keep = {k: v for k, v in a.items() if not k.startswith(WALL_CLOCK)}
        assert keep == {k: v for k, v in b.items() if not k.startswith(WALL_CLOCK)}, a["step"]


def nodes_of(placement: dict, role: str, ray_nodes) -> list[str]:
    return [ray_nodes.name_of(rank["node_id"]) for rank in placement[role]]


def test_a_tp2_actor_on_one_node_syncs_a_separate_engine_on_another(
    local_ray, ray_nodes, tmp_path, model_cache
):
    one, many, placement = one_node_and_cluster_runs(
        tmp_path,
        model_cache,
        ray_nodes,
        "cluster.n_gpus_per_node=2",
        "actor.parallel.tensor_model_parallel_size=2",
        "actor.ppo_micro_batch_size_per_gpu=8",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "rollout.mode=separate",
        "rollout.num_devices=1",
    )
    # the trainer's two devices are one node's share: node a, the only one with two; the engine on b
    assert nodes_of(placement, "actor_rollout_ref", ray_nodes) == ["a", "a"]
    assert nodes_of(placement, "critic", ray_nodes) == ["a", "a"]
    assert nodes_of(placement, "rollout", ray_nodes) == ["b"]
    assert [ray_nodes.name_of(e["node_id"]) for e in placement["engines"]] == ["b"]
    assert_equal_but_wall_clock(one, many)
    for record in many[1:]:  # the broadcast reached the engine on the other node: its log-probs agree
        assert record["rollout/logprob_abs_diff_max"] < 1e-3 and record["weight_sync/num_tensors"] == 21


def test_colocated_across_two_nodes_each_node_holds_its_ranks_and_engine(
    local_ray, ray_nodes, tmp_path, model_cache
):
    with ray_nodes.hold("a", 1):  # one free device on each node
        one, many, placement = one_node_and_cluster_runs(
            tmp_path,
            model_cache,
            ray_nodes,
            "cluster.nnodes=2",
            "cluster.n_gpus_per_node=1",
            "actor.ppo_micro_batch_size_per_gpu=8",
            "critic.ppo_micro_batch_size_per_gpu=8",
        )
    actor = nodes_of(placement, "actor_rollout_ref", ray_nodes)
    assert sorted(actor) == ["a", "b"], actor  # rank r on the pool's node r
    assert nodes_of(placement, "critic", ray_nodes) == actor  # critic rank r beside actor rank r
    engines = [(e["host"], ray_nodes.name_of(e["node_id"])) for e in placement["engines"]]
    assert engines == [("actor_rollout_ref rank 0", actor[0]), ("actor_rollout_ref rank 1", actor[1])]
    assert_equal_but_wall_clock(one, many)
