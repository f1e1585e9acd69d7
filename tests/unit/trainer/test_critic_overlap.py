"""``trainer.overlap_critic`` in the critic's role handle: with overlap its calls start on the ranks and
return at once, the driver collecting them later (values cut from the batch as it was when started,
the update's divergence guard applied on collection); without it they run to the end when started.
The group is a recording stand-in for the Ray worker group (two data-parallel ranks, no processes)."""

from __future__ import annotations

import math

import pytest
import torch

from rltrain.algo.loss_specs import CriticLoss
from rltrain.config.trainer import TrainerConfig
from rltrain.data.step_batch import build_step_batch
from rltrain.errors import DivergenceError
from rltrain.trainer.roles import CriticRole

LOSS = CriticLoss(loss_agg_mode="token-mean", loss_scale_factor=None, cliprange_value=0.5)


class RecordingCriticGroup:
    """Two data-parallel ranks; ``compute_values`` answers each rank's rows' first token id as the
    value of every response position, ``update_critic`` the next of ``updates``. ``events`` records
    each submission, wait and blocking call in order."""

    role, world_size = "critic", 2

    def __init__(self, updates: list[dict[str, float]] | None = None) -> None:
        self.events: list[str] = []
        self.updates = list(updates or [])

    def call(self, method: str, *args):
        assert method == "rank_info"
        return [{"dp_rank": r, "dp_size": 2} for r in range(2)]

    def _answer(self, method: str, per_rank_args: list[tuple]) -> list:
        if method == "compute_values":
            return [
                part.input_ids[:, :1].float().expand(-1, part.response_len).clone()
                for (part,) in per_rank_args
            ]
        assert method == "update_critic"
        assert [loss for _, loss in per_rank_args] == [LOSS, LOSS]  # every rank gets the run's loss
        metrics = [self.updates.pop(0)]
        return [metrics, metrics]

    def call_each(self, method: str, per_rank_args: list[tuple]) -> list:
        self.events.append(f"call {method}")
        return self._answer(method, per_rank_args)

    def submit_each(self, method: str, per_rank_args: list[tuple]) -> list:
        self.events.append(f"submit {method}")
        return self._answer(method, per_rank_args)  # the "refs": what the ranks will answer

    def wait(self, method: str, refs: list) -> list:
        self.events.append(f"wait {method}")
        return refs


def batch_of(first: int, second: int):
    """Four samples (two prompts, n=2): the rows of the first prompt start with token ``first``, those
    of the second with ``second``."""
    return build_step_batch(
        prompt_ids=[[first, 6], [second, 7]],
        response_ids=[[1, 2], [3], [4], [9, 9]],
        response_logprobs=[[-0.1, -0.2], [-0.3], [-0.4], [-0.5, -0.6]],
        finish_reasons=["stop"] * 4,
        n=2,
        data_sources=["arithmetic"] * 2,
        ground_truths=["3", "4"],
        pad_token_id=0,
        response_length=2,
    )


def update_metrics(*, loss: float, skipped: bool = False) -> dict[str, float]:
    return {
        "critic/loss": loss,
        "critic/grad_norm": loss,
        "critic/lr": 1e-3,
        "critic/skipped_steps": float(skipped),
        "critic/param_max_abs": 0.5,
    }


def test_overlapped_values_start_now_and_are_collected_later_in_rank_order():
    group = RecordingCriticGroup()
    critic = CriticRole(group, overlap=True)
    batch = batch_of(5, 8)
    pending = critic.start_values(batch)
    assert group.events == ["submit compute_values"]  # started, not waited for
    first_token = batch.input_ids[:, 0].float()
    batch.input_ids = torch.zeros_like(batch.input_ids)  # later changes to the batch do not reach it
    values = pending.result()
    assert group.events == ["submit compute_values", "wait compute_values"]
    # rank 0 holds samples 0-1, rank 1 samples 2-3: concatenated back in sample order
    assert values.tolist() == [[float(t)] * 2 for t in first_token.tolist()]


def test_without_overlap_a_call_has_finished_when_start_returns():
    group = RecordingCriticGroup([update_metrics(loss=0.25)])
    critic = CriticRole(group)
    pending_values = critic.start_values(batch_of(5, 8))
    pending_update = critic.start_update([batch_of(5, 8)], LOSS)
    assert group.events == ["call compute_values", "call update_critic"]
    assert pending_update.result() == [update_metrics(loss=0.25)]
    assert pending_values.result().tolist() == [[5.0, 5.0], [5.0, 5.0], [8.0, 8.0], [8.0, 8.0]]
    assert group.events == ["call compute_values", "call update_critic"]  # nothing more ran


def test_an_overlapped_update_passes_the_divergence_guard_when_collected():
    bad = update_metrics(loss=math.nan, skipped=True)
    group = RecordingCriticGroup([bad, bad])
    critic = CriticRole(group, trainer=TrainerConfig(max_consecutive_skipped_steps=2), overlap=True)
    assert critic.start_update([batch_of(5, 8)], LOSS).result() == [bad]
    second = critic.start_update([batch_of(5, 8)], LOSS)  # submitted: nothing checked yet
    assert group.events[-1] == "submit update_critic"
    with pytest.raises(DivergenceError, match=r"^critic diverged: 2 optimizer steps in a row"):
        second.result()
