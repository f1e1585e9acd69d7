"""MoE routing replay at EP=2 on two gloo ranks: R2 (see ``replay_case``) and R3 (``r3_case``)."""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from megatron_cases import r3_case, replay_case

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded_rows"])
def test_r2_replays_recorded_routing_exactly_at_ep2(packed: bool) -> None:
    for rank, r in enumerate(run_ranks(replay_case, 2, packed)):
        print(f"rank {rank}: {r}")
        assert r["layers"] == 3
        assert r["recorded_vs_router"] == 0, "the recorded routes are not what the routers chose"
        assert r["replay_logprob_diff"] < 1e-6, "replaying the recorded routes changed the logprobs"
        assert r["replay_mismatch_after_update"] == 0, "the replayed routing differs from the recorded"
        assert r["free_agreement_after_update"] < 1.0, "the update did not move any route: no evidence"


def test_r3_replays_the_engines_routes_in_every_pass_at_ep2() -> None:
    for rank, r in enumerate(run_ranks(r3_case, 2, True)):
        print(f"rank {rank}: {r}")
        assert r["refusal"] == (
            "router_replay.mode=R3: role='actor' got a batch without routed_experts "
            "(R3 replays the rollout engine's routes)"
        )
        assert not r["recorded"], "R3 recorded the trainer's own routing instead of replaying"
        assert r["old_logprob_mismatch"] == 0, "the old-logprob pass did not route as the engine did"
        assert r["update_mismatch"] == 0, "the update's forward did not route as the engine did"
        assert r["after_update_mismatch"] == 0, "after the update the routers chose for themselves"
