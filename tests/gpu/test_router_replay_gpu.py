"""MoE routing replay on one CUDA device (EP=1): the CPU suite's R2 and R3 cases
(``tests/dist/megatron/megatron_cases.py``: ``replay_case``, ``r3_case``) with the routers, the
recorded routes and the replay targets on the GPU, and the same checks. Packed rows only: the GPU
path refuses padded ones (``forward.run_model``).

First run (2026-12-04, an H200 without Transformer Engine) failed before any replay: Megatron's TE
layer spec (``NameError: name 'TESpecProvider' is not defined``; rltrain now builds the local layers
there, with a warning) and its MoE router (``NameError: name 'te_general_gemm' is not defined``;
``cpu_compat``'s replacement now also applies on CUDA without TE)."""

from __future__ import annotations

from gpu_env import gpu_only

pytestmark = gpu_only("megatron", "transformers")


def test_r2_replays_recorded_routing_exactly_on_cuda() -> None:
    from dist_harness import run_ranks
    from megatron_cases import check_r2, replay_case

    check_r2(run_ranks(replay_case, 1, True, 1, timeout_s=240))


def test_r3_replays_the_engines_routes_in_every_pass_on_cuda() -> None:
    from dist_harness import run_ranks
    from megatron_cases import check_r3, r3_case

    check_r3(run_ranks(r3_case, 1, True, 1, timeout_s=240))
