"""The model-converter seam (``rltrain.megatron.converters``) with a test converter, a low-rank
additive adapter on the column-parallel linears (``converter_cases.LowRankAdapters``): forward,
optimizer, checkpoint and weight export against a plain model and hand-computed merges."""

from __future__ import annotations

import pytest
from converter_cases import converter_case
from dist_harness import run_ranks

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    (out,) = run_ranks(converter_case, 1, str(tmp_path_factory.mktemp("converter")))
    print(out)
    return out


def test_adapters_are_the_only_trainable_parameters(result) -> None:
    # 2 layers x (linear_qkv, linear_fc1) x (A, B); the bridge sees exactly the plain model's names.
    assert result["num_adapter_params"] == 8
    assert result["mapped_equal_plain"]
    assert result["optimizer_is_adapters"], "the optimizer holds other parameters than the adapters"
    assert result["ddp_is_adapters"], "DDP's grad buffers hold other parameters than the adapters"


def test_zero_initialized_adapters_leave_the_logits_unchanged(result) -> None:
    assert result["init_logprob_diff"] == 0.0


def test_one_step_moves_only_the_adapters(result) -> None:
    assert result["base_max_change"] == 0.0, "a frozen base weight changed"
    # Adam's first step moves an element by lr * g / (|g| + eps): lr where the gradient is not tiny.
    assert abs(result["b_max_abs"] - 1e-3) <= 1e-5, "B did not move from zero by one Adam step"
    # A's gradient is zero while B is zero: AdamW's decoupled decay alone, A <- A (1 - lr wd).
    assert result["lr"] == 1e-3 and result["weight_decay"] == 0.01
    assert result["a_max_change"] > 1e-6
    assert result["a_decay_error"] <= 1e-8


def test_adapted_forward_equals_the_merged_weights(result) -> None:
    assert 0.0 < result["merged_logprob_diff"] <= 1e-5


def test_export_sends_hand_merged_weights_under_the_original_names(result) -> None:
    assert result["export_names_equal"], "exported names differ from the plain model's"
    assert result["export_max_diff"] == 0.0
    # q, k, v, gate and up of each of the 2 layers carry a merged delta; nothing else changed.
    assert result["export_num_merged"] == 10
    assert result["export_num_tensors"] == 2 * 9 + 3


def test_checkpoint_round_trips_restore_the_adapters(result) -> None:
    assert result["fresh_adapter_diff_before_load"] > 1e-5
    assert result["full_loaded_step"] == 1
    assert result["full_round_trip_diff"] == 0.0
    # adapters only: (linear_qkv, linear_fc1) x (A, B), stacked over the layers; the base untouched
    assert result["adapters_ckpt_num_keys"] == 4, result
    assert result["adapters_ckpt_non_adapter_keys"] == []
    assert result["adapters_round_trip_diff"] == 0.0
    assert result["adapters_base_change"] == 0.0
    assert result["adapters_base_differs_from_saved"] > 1e-3
