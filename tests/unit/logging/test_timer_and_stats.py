"""Stage timing with a fake clock, and summary statistics against hand-computed values."""

from __future__ import annotations

import math

import pytest

from rltrain.logging.metrics import STAGES, length_metrics, summary_stats, throughput_metrics
from rltrain.logging.timer import StageTimer


class FakeClock:
    def __init__(self, times: list[float]) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_stages_accumulate_in_stage_order() -> None:
    timer = StageTimer(clock=FakeClock([0.0, 1.5, 2.0, 2.25, 3.0, 3.5, 10.0, 17.0]))
    with timer.stage("reward"):
        pass  # 1.5 s
    with timer.stage("generate"):
        pass  # 0.25 s
    with timer.stage("reward"):
        pass  # 0.5 s, added to the first 1.5 s
    with timer.stage("step"):
        pass  # 7 s
    assert timer.metrics() == {"timing_s/generate": 0.25, "timing_s/reward": 2.0, "timing_s/step": 7.0}
    assert list(timer.metrics()) == ["timing_s/generate", "timing_s/reward", "timing_s/step"]
    timer.reset()
    assert timer.metrics() == {}


def test_failing_stage_is_still_timed_and_sync_runs_at_both_ends() -> None:
    calls: list[str] = []
    timer = StageTimer(clock=FakeClock([1.0, 4.0]), sync=lambda: calls.append("sync"))
    with pytest.raises(RuntimeError, match="boom"), timer.stage("update_actor"):
        raise RuntimeError("boom")
    assert timer.metrics() == {"timing_s/update_actor": 3.0}
    assert calls == ["sync", "sync"]


def test_unknown_stage_is_refused() -> None:
    timer = StageTimer()
    with pytest.raises(ValueError, match=r"unknown timing stage 'generat'; known: \['generate'"):
        timer.stage("generat").__enter__()
    assert STAGES == (
        "generate",
        "reward",
        "old_logprob",
        "ref",
        "values",
        "advantages",
        "update_actor",
        "update_critic",
        "weight_sync",
    )


def test_real_clock_measures_elapsed_time() -> None:
    import time

    timer = StageTimer()
    with timer.stage("weight_sync"):
        time.sleep(0.02)
    assert 0.02 <= timer.metrics()["timing_s/weight_sync"] < 1.0


def test_summary_stats_hand_values() -> None:
    stats = summary_stats("reward/score", [1.0, 2.0, 3.0, 4.0])
    assert stats == {
        "reward/score/mean": 2.5,
        "reward/score/std": pytest.approx(math.sqrt(1.25)),  # (2.25 + 0.25 + 0.25 + 2.25) / 4
        "reward/score/min": 1.0,
        "reward/score/max": 4.0,
    }
    with pytest.raises(ValueError, match="cannot summarize 'x': no values"):
        summary_stats("x", [])


def test_length_and_throughput_metrics() -> None:
    metrics = length_metrics([10, 20], [5, 64, 64, 3], max_response_length=64)
    assert metrics == {
        "prompt/length/mean": 15.0,
        "prompt/length/min": 10.0,
        "prompt/length/max": 20.0,
        "response/length/mean": 34.0,
        "response/length/min": 3.0,
        "response/length/max": 64.0,
        "response/clip_ratio": 0.5,
    }
    assert throughput_metrics(num_tokens=1000, step_seconds=4.0) == {
        "perf/num_tokens": 1000.0,
        "perf/tokens_per_s": 250.0,
    }
