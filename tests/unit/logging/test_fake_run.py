"""Data, rewards and logging composed over a three-step fake run (no model): what lands on disk."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from rltrain.data.dataset import PromptDataset
from rltrain.data.loader import PromptLoader
from rltrain.data.tasks import arithmetic_splits
from rltrain.logging import MetricsLogger, StageTimer, StepProgress, plot_run
from rltrain.models.tiny import build_tiny_tokenizer
from rltrain.rewards import RewardManager


class TickClock:
    """Each reading advances by one second."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_three_step_fake_run(tmp_path: Path) -> None:
    train_rows, _ = arithmetic_splits(num_train=12, num_val=0, seed=2, max_operand=9)
    dataset = PromptDataset.from_rows(train_rows, build_tiny_tokenizer(), name="arith", max_prompt_length=64)
    loader = PromptLoader(dataset, 4, seed=0)
    rewards = RewardManager()
    timer = StageTimer(clock=TickClock())
    expected_accuracy = []
    with (
        MetricsLogger(tmp_path, total_steps=3, console=io.StringIO()) as logger,
        StepProgress(3, file=io.StringIO()) as progress,
    ):
        for step in range(1, 4):
            timer.reset()
            batch = loader.next_batch()
            with timer.stage("generate"):
                # a "policy" that answers the prompts of even row index correctly and others with 0 - 1
                responses = [ex.ground_truth if ex.index % 2 == 0 else "-1" for ex in batch.examples]
            with timer.stage("reward"):
                out = rewards(responses, ground_truths=batch.ground_truths, data_sources=batch.data_sources)
            correct = [ex.index % 2 == 0 or ex.ground_truth == "-1" for ex in batch.examples]
            expected_accuracy.append(sum(correct) / 4)
            metrics = {**out.metrics, **timer.metrics(), "data/epoch": float(batch.epoch)}
            logger.log(metrics, step=step)
            progress.update(metrics)

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["reward/accuracy"] for r in records] == pytest.approx(expected_accuracy)
    assert [r["reward/score/mean"] for r in records] == pytest.approx(expected_accuracy)
    assert all(r["timing_s/generate"] == 1.0 and r["timing_s/reward"] == 1.0 for r in records)
    assert [r["data/epoch"] for r in records] == [0.0, 0.0, 0.0]
    assert plot_run(tmp_path).is_file()
