"""tools/slurm/ray_cluster.sbatch's multi-node path on a real Slurm cluster of two nodes on this
machine (``start_local_slurm.sh 2``: nodes HOST-1 and HOST-2, a slurmd each, Slurm's own ports + 100,
so the one-node cluster of ``test_slurm_sbatch.py`` is left alone).

The job gets both nodes: the script starts the Ray head on the first through ``srun``, a Ray worker on
the second, waits until both joined, and runs the quickstart with ``cluster.nnodes=2`` from the
allocation. The nodes' names resolve nowhere (nor, here, would the machine's own name resolve beyond
127.0.0.1), so the head's address is the one Ray picks on the head, which the worker node reaches.
Each node gives Ray one CPU, so the trainer's two one-CPU bundles can only land one per node: each
node holds one actor rank and its colocated engine. The run's metrics equal the same run on the
one-node Ray of the other e2e tests in every key but wall-clock times, and Ray is gone from both
nodes after the job.

What this cannot cover: two hosts. Every node here has the machine's address, so a rendezvous at a
wrong node's address would not fail (docs/launching.md, "Multi-node notes").
"""

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest

from rltrain.config import load_config
from rltrain.logging.plot import read_metrics
from tests.e2e.slurm.jobs import JOB_TIMEOUT_S, ROOT, start_local_slurm, submit
from tests.e2e.wall_clock import assert_equal_but_wall_clock

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TWO_NODES_CONF = "/var/lib/rltrain-slurm-2/slurm.conf"  # where start_local_slurm.sh 2 writes it
RUN = [
    "trainer.total_training_steps=2",
    "critic.warmup_steps=0",
    "trainer.save_freq=2",
    "actor.ppo_micro_batch_size_per_gpu=8",
    "critic.ppo_micro_batch_size_per_gpu=8",
]


@pytest.fixture(scope="module")
def two_nodes():
    """The two nodes' names and CPU counts; Slurm's commands in this module talk to their cluster."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SLURM_CONF", TWO_NODES_CONF)
        yield start_local_slurm(2)


def one_node_run(tmp_path: Path) -> list[dict]:
    """The same run on the local one-node Ray (in this process), building the model the job reuses."""
    from rltrain.orchestrator.entry import train

    overrides = [
        f"trainer.default_local_dir={tmp_path / 'one_node'}",
        f"model.cache_dir={tmp_path / 'cache'}",
        "trainer.test_freq=0",
        "cluster.nnodes=2",
        "cluster.n_gpus_per_node=1",
        *RUN,
    ]
    config = load_config(ROOT / "recipes" / "quickstart_cpu.yaml", overrides)
    assert train(config) == 2
    return read_metrics(config.run_dir())


def test_the_script_runs_ray_across_two_slurm_nodes_one_rank_each(two_nodes, local_ray, tmp_path):
    import ray.util

    (head, cpus), (worker, _) = two_nodes
    one = one_node_run(tmp_path)
    job = submit(tmp_path, RUN, cpus=cpus, nodes=2, env=("CPUS_PER_NODE=1",))
    try:
        state = job.wait_until_ended(timeout_s=JOB_TIMEOUT_S)
    finally:
        job.cancel()
    log = job.log()
    assert state == "COMPLETED", f"job {job.job_id} ended {state}\n{job.report()}"
    address = ray.util.get_node_ip_address()  # the machine's own: what Ray uses on the head node
    assert not address.startswith("127."), address
    assert f"rltrain: the head node {head} resolves to nothing; using its address {address}" in log, log
    assert f"rltrain: 2 node(s) {head} {worker}; head {head} ({address}:{job.gcs_port})" in log, log
    assert "rltrain: all 2 node(s) joined" in log, log
    assert "joined the running Ray cluster" in log  # the driver's own line: not a Ray of its own
    assert "rltrain: stopping Ray on all nodes" in log and " failed (exit " not in log, log

    run_dir = tmp_path / "runs" / "quickstart" / "tiny_llama_arith"
    placement = json.loads((run_dir / "placement.json").read_text())
    actor = [rank["node_id"] for rank in placement["actor_rollout_ref"]]
    assert len(actor) == 2 and actor[0] != actor[1], placement  # one rank on each Slurm node's Ray
    engines = [(e["host"], e["node_id"]) for e in placement["engines"]]
    assert engines == [("actor_rollout_ref rank 0", actor[0]), ("actor_rollout_ref rank 1", actor[1])]
    assert_equal_but_wall_clock(one, read_metrics(run_dir))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_2"

    # torn down on both nodes: the head's port is closed and no process of the job's Ray is left
    time.sleep(2)
    with socket.socket() as s:
        assert s.connect_ex((address, job.gcs_port)) != 0, "the Ray head is still running after the job"
    leftovers = subprocess.run(["pgrep", "-af", f"{job.ray_tmp}/"], capture_output=True, text=True).stdout
    assert leftovers == "", f"Ray processes of the job survived it: {leftovers}"
