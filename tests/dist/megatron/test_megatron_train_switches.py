"""Train-step switches on CPU: a non-finite gradient norm skips the update and says so; activation
recomputation gives the same loss and gradient norm; offload switches do not break a step; a bf16
actor loaded from HF keeps the loaded weights through a step at lr 0 (its optimizer's fp32 main
copies are the loaded weights, not the initialisation); at DP=1 the gradient and parameter buffer
collectives are skipped and the steps stay bit-identical; the optimizer is torch's fused AdamW and
its first step equals AdamW's by hand."""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from megatron_cases import bf16_hf_load_case, fused_adam_case, single_rank_collectives_case, switches_case

pytestmark = pytest.mark.dist


def test_nan_skips_and_recompute_matches() -> None:
    (result,) = run_ranks(switches_case, 1)
    print(result)
    assert result["nan_skipped"] == 1.0 and result["nan_params_unchanged"] == 1.0
    assert result["nan_grad_norm_finite"] == 0.0
    assert result["recompute=False_first_skipped"] == 0.0 and result["recompute=True_first_skipped"] == 0.0
    for name in ("loss", "grad_norm"):
        plain, recomputed = result[f"recompute=False_{name}"], result[f"recompute=True_{name}"]
        assert abs(plain - recomputed) <= 1e-6 * max(1.0, abs(plain)), (name, plain, recomputed)


def test_a_bf16_actor_trains_from_the_loaded_weights(tmp_path) -> None:
    (result,) = run_ranks(bf16_hf_load_case, 1, str(tmp_path))
    print(result)
    for distributed in (True,):
        key = f"distributed={distributed}"
        assert result[f"{key}_skipped"] == 0.0
        assert result[f"{key}_load_changed"] > 1e-3  # the load replaced the initialisation: a real test
        assert result[f"{key}_step_changed"] == 0.0, result


def test_single_rank_steps_skip_the_buffer_collectives_and_stay_bit_identical() -> None:
    (result,) = run_ranks(single_rank_collectives_case, 1)
    print(result)
    # two steps, each one gradient reduce-scatter and one parameter all-gather per bucket group
    assert result["real_calls"] >= 4, result  # the real run did call them: the comparison is real
    assert result["shortcut_calls"] == 0.0, result
    assert result["max_diff"] == 0.0, result


def test_the_fused_adamw_step_is_adamws_by_hand() -> None:
    (result,) = run_ranks(fused_adam_case, 1)
    print(result)
    assert result["fused"] == 1.0, result
    assert result["max_move"] > 5e-4, result  # lr 1e-3 moves every parameter with a gradient by ~lr
    assert result["max_diff"] < 1e-6, result
