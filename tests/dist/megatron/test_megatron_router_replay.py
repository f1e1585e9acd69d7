"""MoE routing replay (router_replay.mode=R2) at EP=2 on two gloo ranks: see ``replay_case``."""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from megatron_cases import replay_case

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
