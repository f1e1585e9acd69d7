"""The quickstart's PPO across the nodes of a real multi-node Ray cluster on this machine
(``conftest.py``: node ``a`` with two stand-in devices, ``b`` and ``c`` with one), each run started as a
user starts one on a cluster (``python -m rltrain.train`` with ``RAY_ADDRESS``) and compared with
the same run on the one-node local Ray of the other e2e tests: the metrics are equal in every key
but wall-clock times (CPU runs are deterministic), and the placement the run wrote
(``placement.json``: each rank's node and process, each engine's node) is the one the layout asks
for.

- the actor at TP=2 fills node ``a``; its separate engine runs on another node and gets every
  weight update by broadcast across the nodes;
- colocated across two nodes (``cluster.nnodes=2``, one device each): each node holds its own actor
  rank and engine, and the critic's pool of its own spans a third node;
- node loss (the module's last test: the killed nodes stay dead): the engine's node is killed after
  step 1's checkpoint; the driver names the node and the ranks it took within seconds, Ray places
  the engine's bundle on the spare node, and the run resumes from step 1. That node is killed in
  turn after step 2's checkpoint, with no spare left: the restart waits until a replacement node
  joins, resumes there from step 2, and ends with the uninterrupted metrics.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rltrain.config import load_config
from rltrain.logging.plot import read_metrics
from tests.e2e.conftest import STAND_IN_GPU
from tests.e2e.wall_clock import assert_equal_but_wall_clock

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
        "trainer.timeouts.init_s=180",  # a layout Ray cannot place stops in 3 minutes, naming it
        *extra,
    ]


SEPARATE = (
    "cluster.n_gpus_per_node=2",
    "actor.parallel.tensor_model_parallel_size=2",
    "actor.ppo_micro_batch_size_per_gpu=8",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "rollout.mode=separate",
    "rollout.num_devices=1",
    "rollout.weight_sync.bucket_size_mb=1",  # several buckets a sync
    "trainer.save_freq=1",  # the node-loss run resumes from step 1's checkpoint
    "trainer.max_restarts=1",
)
"""A TP=2 actor (and critic) on a node's two devices, one separate engine on a device of its own."""


def one_node_run(tmp_path: Path, cache: Path, *layout: str) -> list[dict]:
    """The metrics of ``layout`` on the local one-node Ray (in this process)."""
    from rltrain.orchestrator.entry import train

    one = load_config(RECIPE, run_overrides(tmp_path, cache, *layout))
    assert train(one) == STEPS
    return read_metrics(one.run_dir())


def cluster_driver(run_root: Path, cache: Path, ray_nodes, *layout: str) -> subprocess.Popen:
    """``python -m rltrain.train`` of ``layout`` on the multi-node cluster."""
    return subprocess.Popen(
        [sys.executable, "-m", "rltrain.train", str(RECIPE), *run_overrides(run_root, cache, *layout)],
        cwd=ROOT,
        env=ray_nodes.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def cluster_run(run_root: Path, cache: Path, ray_nodes, *layout: str) -> tuple[list, dict]:
    """The metrics and ``placement.json`` of ``layout`` on the multi-node cluster."""
    driver = cluster_driver(run_root, cache, ray_nodes, *layout)
    out, _ = driver.communicate(timeout=RUN_TIMEOUT_S)
    assert driver.returncode == 0, out[-5000:]
    run_dir = load_config(RECIPE, run_overrides(run_root, cache, *layout)).run_dir()
    return read_metrics(run_dir), json.loads((run_dir / "placement.json").read_text())


@pytest.fixture(scope="module")
def separate_one_node(local_ray, tmp_path_factory, model_cache) -> list[dict]:
    """The one-node run of :data:`SEPARATE` (shared by the layout and node-loss tests)."""
    return one_node_run(tmp_path_factory.mktemp("separate_one_node"), model_cache, *SEPARATE)


def nodes_of(placement: dict, role: str, ray_nodes) -> list[str]:
    return [ray_nodes.name_of(rank["node_id"]) for rank in placement[role]]


def test_a_tp2_actor_on_one_node_syncs_a_separate_engine_on_another(
    ray_nodes, tmp_path, model_cache, separate_one_node
):
    many, placement = cluster_run(tmp_path, model_cache, ray_nodes, *SEPARATE)
    # the trainer's two devices are one node's share: node a, the only one with two; the engine apart
    assert nodes_of(placement, "actor_rollout_ref", ray_nodes) == ["a", "a"]
    assert nodes_of(placement, "critic", ray_nodes) == ["a", "a"]
    (engine,) = nodes_of(placement, "rollout", ray_nodes)
    assert engine in ("b", "c")
    assert [ray_nodes.name_of(e["node_id"]) for e in placement["engines"]] == [engine]
    assert_equal_but_wall_clock(separate_one_node, many)
    for record in many[1:]:  # the broadcast reached the engine on the other node: its log-probs agree
        assert record["rollout/logprob_abs_diff_max"] < 1e-3
        assert record["weight_sync/num_tensors"] == 21 and record["weight_sync/buckets"] >= 2  # 1 MiB buckets
    assert abs(many[-1]["actor/kl"]) > 1e-6  # the actor moved: the engine samples from updated weights


def test_colocated_ranks_on_two_nodes_and_the_critic_pool_on_a_third(
    local_ray, ray_nodes, tmp_path, model_cache
):
    """The trainer's pool over two nodes of one device (``cluster.nnodes=2``), each node with its
    actor rank and that rank's engine; the critic on a pool of its own, one node's two devices: all
    four devices of the cluster, so the placement is the only one that fits."""
    layout = (
        "cluster.nnodes=2",
        "cluster.n_gpus_per_node=1",
        "cluster.resource_pools.critic_pool.n_gpus_per_node=2",
        "cluster.role_pool.critic=critic_pool",
        "actor.ppo_micro_batch_size_per_gpu=8",
        "critic.ppo_micro_batch_size_per_gpu=8",
    )
    one = one_node_run(tmp_path / "one_node", model_cache, *layout)
    many, placement = cluster_run(tmp_path / "nodes", model_cache, ray_nodes, *layout)
    actor = nodes_of(placement, "actor_rollout_ref", ray_nodes)
    assert sorted(actor) == ["b", "c"], actor  # rank r on the pool's node r
    assert nodes_of(placement, "critic", ray_nodes) == ["a", "a"]
    engines = [(e["host"], ray_nodes.name_of(e["node_id"])) for e in placement["engines"]]
    assert engines == [("actor_rollout_ref rank 0", actor[0]), ("actor_rollout_ref rank 1", actor[1])]
    assert_equal_but_wall_clock(one, many)


def test_gloo_groups_across_nodes_connect_at_the_nodes_addresses(ray_nodes):
    """The machine's hostname resolves to 127.0.0.1 (as in many containers), where gloo binds by
    default: a rank on another host would be told to connect to its own loopback. The run's ranks
    bind gloo to their node's address."""
    probe = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("gloo_probe.py")), ray_nodes.address],
        cwd=ROOT,
        env=ray_nodes.env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    report = json.loads(probe.stdout.splitlines()[-1])
    assert report["pair_addresses"] == [[ip] for ip in report["node_ips"]], report
    assert "127.0.0.1" not in report["node_ips"]


def test_a_restart_waits_for_a_replacement_node_within_its_bound(ray_nodes):
    """A group whose node is lost, with no other node that can hold it: the wait a restart makes
    (``NodeGroups.wait_placed(again=True)``) stops at its bound naming the group; once a replacement
    node joins, it returns with the group placed there."""
    from tests.e2e.multinode.conftest import _read_line

    ray_nodes.add("x:2:1")
    probe = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("replacement_probe.py")),
            ray_nodes.address,
            STAND_IN_GPU,
        ],
        cwd=ROOT,
        env=ray_nodes.env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def said(timeout_s: float) -> str:
        """The probe's next line of its own (Ray prints a node's death there too)."""
        while not (line := _read_line(probe, timeout_s, "the probe")).startswith("probe: "):
            pass
        return line.removeprefix("probe: ").strip()

    def wait(seconds: float) -> str:
        probe.stdin.write(f"wait {seconds}\n")
        probe.stdin.flush()
        return said(seconds + 60)

    try:
        assert said(120).split() == ["placed", ray_nodes.node_ids["x"]]
        ray_nodes.kill("x")

        assert wait(5) == (
            f"timeout Ray could not place the run's bundles 0..0 [{{'CPU': 1, '{STAND_IN_GPU}': 1, 'node_x': 0.01}}] "
            f"on one node again within 5 s (trainer.timeouts.init_s); the cluster's nodes have "
            f"[{{'CPU': 4.0}}, {{'CPU': 4.0}}, {{'CPU': 4.0}}] (other jobs may hold part of them)"
        )
        replacement = ray_nodes.add("y:2:1:x")  # holds node_x too: it stands in for x
        started = time.monotonic()
        assert wait(120) == f"placed {replacement}"
        print(f"placed again on the replacement node {time.monotonic() - started:.1f} s after it joined")
    finally:
        probe.stdin.close()
        probe.wait(timeout=60)


def test_a_lost_node_is_named_and_the_run_resumes_on_a_spare_then_on_a_replacement_node(
    ray_nodes, tmp_path, model_cache, separate_one_node
):
    """Last in the module: the killed nodes stay dead. One run, two losses of the separate engine's
    node: after step 1's checkpoint, with a spare node of one device left (the run resumes there at
    once), then after step 2's, with none (the restart waits, bounded by ``trainer.timeouts.init_s``,
    until a replacement node joins, and resumes there)."""
    for extra in [n for n in ray_nodes.alive() if n != "a"][2:]:  # a's two devices and two spares
        ray_nodes.kill(extra)
    layout = (*SEPARATE, "trainer.max_restarts=2")
    run_dir = load_config(RECIPE, run_overrides(tmp_path, model_cache, *layout)).run_dir()
    latest, log_file = run_dir / "checkpoints" / "latest", run_dir / "rltrain.log"

    def engine_node() -> str:
        (engine,) = nodes_of(json.loads((run_dir / "placement.json").read_text()), "rollout", ray_nodes)
        return engine

    def lose_the_engine_node_after(step: int, restart: int) -> tuple[str, float]:
        """Kill the engine's node once step ``step`` is saved; the node and the seconds until the
        driver named it."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (latest.exists() and latest.read_text().strip() == f"step_{step}"):
            assert driver.poll() is None and time.monotonic() < deadline, f"no checkpoint step_{step}"
            time.sleep(0.1)
        engine = engine_node()
        node_id = ray_nodes.node_ids[engine]
        ray_nodes.kill(engine)
        killed = time.monotonic()
        lost = re.compile(
            rf"WARNING rltrain\.trainer\.recovery: rollout rank 0 \(\w+\): the worker process died \(\w+\); "
            rf"its node {node_id[:8]} \(\S+\) is lost, and with it rollout rank 0: restarting every worker "
            rf"group and resuming from the last good checkpoint \(restart {restart} of 2, trainer\.max_restarts\)"
        )
        while not lost.search(log_file.read_text()):
            assert driver.poll() is None and time.monotonic() < killed + 60, (
                f"the lost node {engine} was not named in 60 s"
            )
            time.sleep(0.05)
        return engine, time.monotonic() - killed

    driver = cluster_driver(tmp_path, model_cache, ray_nodes, *layout)
    try:
        first, first_named = lose_the_engine_node_after(1, restart=1)
        (spare,) = set(ray_nodes.alive()) - {"a"}
        second, second_named = lose_the_engine_node_after(2, restart=2)
        assert second == spare, (first, second, spare)  # resumed on the spare
        time.sleep(3)  # the restart now waits: no node left has a device to spare
        joined = time.monotonic()
        ray_nodes.add("z:4:1")
        added = time.monotonic() - joined
        out, _ = driver.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        driver.kill()
    assert driver.returncode == 0, out[-5000:]
    log = log_file.read_text()
    recovered = re.findall(r"restart (\d) of 2: resumed from step (\d), (\d+\.\d) s after the failure", log)
    assert [(r, step) for r, step, _ in recovered] == [("1", "1"), ("2", "2")], log[-3000:]
    (_, _, spare_s), (_, _, replaced_s) = recovered
    print(
        f"node {first} lost: named {first_named:.1f} s after the kill, training again {spare_s} s after "
        f"the failure on the spare node {second}; node {second} lost: named {second_named:.1f} s after "
        f"the kill, training again {replaced_s} s after the failure on the replacement node z (which "
        f"joined 3 s after the failure and took {added:.1f} s to start)"
    )
    assert first_named < 30 and second_named < 30  # the raylet's port tells at once; the GCS takes 15 s+
    assert float(replaced_s) > 3  # it waited for the replacement
    assert engine_node() == "z"
    assert_equal_but_wall_clock(separate_one_node, read_metrics(run_dir), also=("trainer/",))
