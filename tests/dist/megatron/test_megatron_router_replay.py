"""MoE routing replay at EP=2 on two gloo ranks: R2 (see ``replay_case``) and R3 (``r3_case``);
``tests/gpu/test_router_replay_gpu.py`` runs the same cases on one CUDA device."""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from megatron_cases import check_r2, check_r3, r3_case, replay_case

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded_rows"])
@pytest.mark.supports("mixtral", "router_replay")
def test_r2_replays_recorded_routing_exactly_at_ep2(packed: bool) -> None:
    check_r2(run_ranks(replay_case, 2, packed))


@pytest.mark.supports("mixtral", "router_replay")
def test_r3_replays_the_engines_routes_in_every_pass_at_ep2() -> None:
    check_r3(run_ranks(r3_case, 2, True))
