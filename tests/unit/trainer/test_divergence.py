"""The driver's divergence guard: a streak of skipped optimizer steps or blown-up parameters stops the
run in one line naming the role and the culprit; a skipped step now and then is tolerated."""

from __future__ import annotations

import math

import pytest

from rltrain.algo.loss_specs import CriticLoss
from rltrain.config.trainer import TrainerConfig
from rltrain.data.step_batch import build_step_batch
from rltrain.errors import DivergenceError, RunStopped
from rltrain.trainer.divergence import DivergenceGuard
from rltrain.trainer.roles import CriticRole

LOSS = CriticLoss(loss_agg_mode="token-mean", loss_scale_factor=None, cliprange_value=0.5)

NAN, INF = math.nan, math.inf


def step(
    role: str = "actor",
    *,
    skipped: bool = False,
    loss: float = 0.5,
    grad_norm: float = 1.0,
    param_max_abs: float = 0.3,
    lr: float = 1e-6,
) -> dict[str, float]:
    """One optimizer step's metrics as the workers report them (``rank_base.step_metrics``' key order)."""
    return {
        f"{role}/loss": loss,
        f"{role}/pg_loss": loss,
        f"{role}/grad_norm": grad_norm,
        f"{role}/lr": lr,
        f"{role}/skipped_steps": float(skipped),
        f"{role}/param_max_abs": param_max_abs,
    }


def test_three_skipped_steps_in_a_row_stop_naming_the_first_non_finite_value():
    guard = DivergenceGuard("actor", max_consecutive_skipped=3, max_param_abs=1e4)
    guard.check([step(), step(skipped=True, loss=NAN, grad_norm=NAN)])
    guard.check([step(skipped=True, loss=INF, grad_norm=INF)])  # the streak carries over updates
    with pytest.raises(DivergenceError) as info:
        guard.check([step(skipped=True, loss=1.0, grad_norm=INF)])
    assert str(info.value) == (
        "actor diverged: 3 optimizer steps in a row skipped for non-finite values "
        "(trainer.max_consecutive_skipped_steps=3); the first had actor/loss=nan"
    )
    assert isinstance(info.value, RunStopped) and "\n" not in str(info.value)


def test_a_good_step_ends_the_streak_and_a_finite_loss_names_the_gradient_norm():
    guard = DivergenceGuard("critic", max_consecutive_skipped=2, max_param_abs=None)
    guard.check([step("critic", skipped=True, grad_norm=NAN), step("critic")])
    guard.check([step("critic", skipped=True, grad_norm=INF)])
    assert guard.skipped_in_a_row == 1
    with pytest.raises(DivergenceError, match=r"the first had critic/grad_norm=inf$"):
        guard.check([step("critic", skipped=True, loss=NAN, grad_norm=NAN)])


def test_a_parameter_past_max_param_abs_stops_at_once_and_null_disables_the_bound():
    guard = DivergenceGuard("actor", max_consecutive_skipped=3, max_param_abs=1e4)
    guard.check([step(param_max_abs=1e4)])  # the bound itself is allowed
    with pytest.raises(DivergenceError) as info:
        guard.check([step(param_max_abs=1.0061978e9, lr=1e9)])
    assert str(info.value) == (
        "actor diverged: a parameter reached magnitude 1.006e+09 after an optimizer step (lr 1e+09), "
        "above trainer.max_param_abs=10000"
    )
    DivergenceGuard("actor", max_consecutive_skipped=3, max_param_abs=None).check([step(param_max_abs=1e30)])


class _CriticGroup:
    """A critic group of two data-parallel ranks whose updates return ``per_update`` in turn."""

    role, world_size = "critic", 2

    def __init__(self, per_update: list[list[dict[str, float]]]) -> None:
        self.per_update = per_update

    def call(self, method: str, *args):
        assert method == "rank_info"
        return [{"dp_rank": r, "dp_size": 2} for r in range(2)]

    def call_each(self, method: str, per_rank_args: list[tuple]):
        assert method == "update_critic" and [loss for _, loss in per_rank_args] == [LOSS, LOSS]
        metrics = self.per_update.pop(0)
        return [metrics, metrics]


def test_a_role_update_raises_before_returning_with_the_runs_limit():
    batch = build_step_batch(
        prompt_ids=[[5, 6], [7]],
        response_ids=[[1, 2], [3], [4], [9, 9]],
        response_logprobs=[[-0.1, -0.2], [-0.3], [-0.4], [-0.5, -0.6]],
        finish_reasons=["stop"] * 4,
        n=2,
        data_sources=["arithmetic"] * 2,
        ground_truths=["3", "4"],
        pad_token_id=0,
        response_length=2,
    )
    good, bad = [step("critic")], [step("critic", skipped=True, loss=NAN, grad_norm=NAN)]
    critic = CriticRole(
        _CriticGroup([good, bad, bad]), trainer=TrainerConfig(max_consecutive_skipped_steps=2)
    )
    assert critic.update([batch], LOSS) == good
    assert critic.update([batch], LOSS) == bad
    with pytest.raises(
        DivergenceError, match=r"^critic diverged: 2 optimizer steps in a row .* critic/loss=nan$"
    ):
        critic.update([batch], LOSS)
    # without a trainer config the defaults hold
    assert CriticRole(_CriticGroup([]), trainer=None).guard == DivergenceGuard("critic", 3, 1e4)
