"""``rank_base.step_metrics``: how one optimizer step's result becomes the step's metric keys."""

from __future__ import annotations

from types import SimpleNamespace

from rltrain.workers.rank_base import step_metrics


def _result(**moe: float) -> SimpleNamespace:
    return SimpleNamespace(
        metrics={"loss": 0.5, "pg_loss": 0.4},
        grad_norm=1.5,
        skipped=False,
        lr=1e-6,
        param_max_abs=0.3,
        moe_metrics=moe,
    )


def test_router_metrics_are_moe_keys_for_the_actor_and_prefixed_for_the_critic() -> None:
    moe = {"moe/aux_loss": 1.25, "moe/layer_1/load_max_over_mean": 1.75}
    assert step_metrics("actor", _result(**moe)) == {
        "actor/loss": 0.5,
        "actor/pg_loss": 0.4,
        "moe/aux_loss": 1.25,
        "moe/layer_1/load_max_over_mean": 1.75,
        "actor/grad_norm": 1.5,
        "actor/lr": 1e-6,
        "actor/skipped_steps": 0.0,
        "actor/param_max_abs": 0.3,
    }
    critic = step_metrics("critic", _result(**moe))
    assert critic["critic/moe/aux_loss"] == 1.25 and "moe/aux_loss" not in critic
    assert "moe/aux_loss" not in step_metrics("actor", _result())
