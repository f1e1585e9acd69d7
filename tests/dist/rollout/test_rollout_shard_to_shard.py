"""Shard-to-shard sync into separate engines (``rltrain.weight_sync.shard_to_shard``): Megatron
trainer ranks on gloo send their planned slices straight to vLLM engines of TP=2 in processes of
their own; every engine worker gets, bit for bit, the regions the colocated path plans for it; each
trainer rank sends exactly the plan's bytes (those the sync-plan simulator counts for its GPU) and
no member's buffers grow past the schedule's bound. See ``shard_to_shard_worker.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rltrain.ports import HeldPort

pytestmark = [pytest.mark.dist, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("shard_to_shard_worker.py")


def run_members(
    tmp_path: Path, layout: str, *, trainers: int, engines: int, actor: Path, engine: Path
) -> tuple:
    """Launch ``trainers`` trainer ranks and ``engines`` engines; return (trainer rank 0's result,
    each engine's result). Each member logs to a file of its own (a pipe nobody reads while
    another member is waited for fills up and blocks the engine's workers mid-load)."""
    base = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    base["OMP_NUM_THREADS"] = "1"
    members = [("trainer", r) for r in range(trainers)] + [("engine", e) for e in range(engines)]
    logs = [tmp_path / f"{role}{i}.log" for role, i in members]
    with HeldPort("127.0.0.1") as master, HeldPort("127.0.0.1") as weights:
        procs = []
        for (role, i), log in zip(members, logs):
            if role == "trainer":
                env = {**base, "RANK": str(i), "LOCAL_RANK": str(i), "WORLD_SIZE": str(trainers)}
                env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master.port)}
                args = [
                    role,
                    layout,
                    str(engines),
                    str(weights.port),
                    str(actor),
                    str(tmp_path / "trainer.json"),
                ]
            else:
                env = base
                out = tmp_path / f"engine{i}.json"
                args = [role, str(i), str(trainers), str(engines), str(weights.port), str(engine), str(out)]
            with open(log, "w") as f:
                procs.append(
                    subprocess.Popen([sys.executable, str(WORKER), *args], env=env, stdout=f, stderr=f)
                )
        try:
            for p in procs:
                p.wait(timeout=600)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    failed = [
        f"{role} {i} exited {p.returncode}:\n{log.read_text()[-3000:]}"
        for (role, i), p, log in zip(members, procs, logs)
        if p.returncode != 0
    ]
    assert not failed, "\n".join(failed)
    result = json.loads((tmp_path / "trainer.json").read_text())
    print(json.dumps({k: result[k] for k in ("metrics", "ranks", "simulated_sent", "num_buckets")}))
    return result, [json.loads((tmp_path / f"engine{e}.json").read_text()) for e in range(engines)]


def check(
    result: dict, engines: list[dict], *, num_tensors: int, read_back_experts: bool, planted_sender: int
) -> None:
    reference = result["reference"]
    assert sorted(reference) == ["0", "1"] and len(reference["0"]) == len(reference["1"]) == num_tensors
    for e, got in enumerate(engines):
        # every worker was handed exactly the regions the colocated path plans for it, bit for bit
        assert got["handed"] == reference, f"engine {e}"
        for worker in ("0", "1"):
            read_back = got["read_back"][int(worker)]
            assert {n: reference[worker][n] for n in read_back} == read_back, f"engine {e} worker {worker}"
            missing = set(reference[worker]) - set(read_back)
            # a CPU engine reads fused MoE experts back only for GPT-OSS (``checksum``)
            assert missing == set() if read_back_experts else all(".experts." in n for n in missing)
        assert got["greedy_changed"]
        second = got["second_sync"]
        # every tensor read back whole at the second sync; a wrong value planted in the last
        # engine's load is named with the trainer rank that sent that region
        assert second["verified"] == len(got["read_back"][0]) + len(got["read_back"][1])
        assert second["problems"] == (
            [
                "weight sync verification failed: model.layers.0.self_attn.o_proj.weight on engine rank 1 "
                f"(separate engine {e}) differs from what trainer rank {planted_sender} sent (sha256 of its "
                "whole shard, sync 1)"
            ]
            if second["planted"]
            else []
        )
        assert got["num_buckets"] == result["num_buckets"] >= 4
        assert 0 < got["peak_extra_bytes"] <= got["extra_bound"]
    for rank in result["ranks"]:
        # what each trainer rank sent is the plan's: its owned slices, once per engine, and the
        # simulator counts the same bytes for its GPU
        assert rank["sent_bytes"] == rank["scheduled_bytes"] == result["simulated_sent"][rank["rank"]] > 0
        assert 0 < rank["peak_extra_bytes"] <= rank["extra_bound"]
    assert engines[-1]["second_sync"]["planted"]
    assert result["metrics"]["weight_sync/gbytes"] * 1e9 == pytest.approx(
        sum(r["sent_bytes"] for r in result["ranks"]), rel=1e-9
    )


@pytest.mark.supports("llama", "vllm_sync", "tp", "pp")
def test_dense_tp2_pp2_into_two_engines_of_tp2(tmp_path):
    from test_rollout_megatron_sync import save_tp2_model

    engine = save_tp2_model(tmp_path / "engine", seed=0)
    actor = save_tp2_model(tmp_path / "actor", seed=1)
    result, engines = run_members(tmp_path, "tp2_pp2", trainers=4, engines=2, actor=actor, engine=engine)
    check(result, engines, num_tensors=21, read_back_experts=True, planted_sender=1)
    # no rank holds more than its own: each of the four sends a part, none all
    sent = [r["sent_bytes"] for r in result["ranks"]]
    assert all(s < sum(sent) / 2 for s in sent)


@pytest.mark.supports("mixtral", "vllm_sync", "ep")
def test_moe_ep2_into_an_engine_of_tp2(tmp_path):
    from rltrain.models.tiny import save_tiny_model

    engine = save_tiny_model(tmp_path / "engine", "mixtral", seed=0)
    actor = save_tiny_model(tmp_path / "actor", "mixtral", seed=1)
    result, engines = run_members(tmp_path, "ep2", trainers=2, engines=1, actor=actor, engine=engine)
    check(result, engines, num_tensors=41, read_back_experts=False, planted_sender=0)
