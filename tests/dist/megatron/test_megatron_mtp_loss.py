"""The MTP loss mode (``model.mtp.enable_train``) of the actor on a tiny DeepSeek-V3 (the released
config, shrunk, with its MTP layer), in one process launch: the loss value against transformers' MTP
logits, the MTP parameters trained only in that mode, the default mode frozen and exported unchanged,
and the policy part untouched by the mode at scaling factor 0."""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from mtp_cases import LAYOUTS, mtp_loss_case, mtp_loss_layouts_case

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    (result,) = run_ranks(mtp_loss_case, 1, str(tmp_path_factory.mktemp("mtp_loss")))
    return result


@pytest.mark.supports("deepseek_v3", "mtp_loss")
def test_mtp_loss_equals_the_cross_entropy_of_transformers_mtp_logits(case):
    reference = case["reference_mtp_loss"]
    ours = case["metrics"]["train"]["actor/mtp_loss"]
    print(f"mtp_loss ours {ours:.8f} reference {reference:.8f}")
    assert 1.0 < reference < 20.0
    assert abs(ours - reference) <= 1e-5
    # a predictor off by one position is far outside the tolerance: the comparison can fail
    assert abs(case["misaligned_reference_mtp_loss"] - reference) > 0.1
    # the same forward in the factor-0 run reports the same MTP loss; the default mode reports none
    assert abs(case["metrics"]["train_factor_0"]["actor/mtp_loss"] - ours) <= 1e-6
    assert "actor/mtp_loss" not in case["metrics"]["ignore"]
    # loss = policy loss + 0.5 × MTP loss
    train = case["metrics"]["train"]
    assert abs(train["loss"] - (train["actor/pg_loss"] + 0.5 * ours)) <= 1e-6


def test_mtp_layers_train_only_in_the_loss_mode(case):
    assert case["num_mtp_tensors"] > 10
    assert not any(case["mtp_trainable"]["ignore"]) and all(case["mtp_trainable"]["train"])
    assert case["mtp_grad_max"]["ignore"] == 0.0 and case["mtp_grad_max"]["train"] > 1e-6
    assert case["mtp_changed"]["train"] > 1e-5
    # default: bit-identical before and after the step, and exported as loaded
    assert case["mtp_unchanged_bitwise"] and case["mtp_changed"]["ignore"] == 0.0
    # except the MTP layer's copies of the embedding and LM head, which are the main model's (trained)
    layer = "model.layers.4."
    assert case["ignore_exports_mtp_changed"] == [
        f"{layer}embed_tokens.weight",
        f"{layer}shared_head.head.weight",
    ]
    assert case["ignore_exported_copies_follow_main"]
    assert case["train_exports_mtp_changed"] > 10
    # checkpoints hold the MTP parameters in either mode and restore them into either
    assert case["num_mtp_params"] > 10
    assert case["checkpoint_train_into_frozen_equal"] and case["checkpoint_frozen_into_trained_equal"]
    # detach_encoder: the MTP loss trains the MTP layers and the shared output layer only
    assert case["mtp_changed"]["train_detached"] > 1e-5
    assert case["detached_main_grads_changed"] == ["output_layer.weight"]
    assert abs(case["metrics"]["train_detached"]["actor/mtp_loss"] - case["reference_mtp_loss"]) <= 1e-5
    # without it, the MTP loss's gradient reaches the main model too
    assert case["train_main_differs"] > 1e-7


def test_the_policy_part_is_unchanged_by_the_mode_at_scaling_factor_0(case):
    ignore, zero = case["metrics"]["ignore"], case["metrics"]["train_factor_0"]
    for name in ("actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac"):
        assert zero[name] == ignore[name], name
    assert zero["loss"] == ignore["loss"]
    # the main model's gradients, the step and the log-probs after it are bit-identical; the
    # gradient norm is equal to fp32 rounding (the optimizer also holds the MTP parameters, with
    # zero gradients, which regroups the norm's sum)
    assert case["factor_0_main_grads_equal"]
    assert case["factor_0_main_params_equal"] and case["factor_0_logprobs_after_equal"]
    norm = case["grad_norm"]["ignore"]
    assert abs(case["grad_norm"]["train_factor_0"] - norm) <= 1e-6 * norm


@pytest.mark.supports("deepseek_v3", "mtp_loss", "pp", "tp")
def test_mtp_loss_at_pp2_tp2_and_with_the_fused_head_equals_the_reference(case):
    results = run_ranks(mtp_loss_layouts_case, 2, case["checkpoint"])
    assert results[0] == results[1]  # every rank reports the step's metrics
    print(results[0])
    assert sorted(results[0]) == sorted(LAYOUTS)
    for name, value in results[0].items():
        assert abs(value - case["reference_mtp_loss"]) <= 1e-5, name


def test_training_mtp_layers_of_a_model_without_them_is_refused_in_one_line(case):
    assert case["refusal_without_mtp_layers"] == (
        "model.mtp.enable_train: the actor of this llama model has no multi-token-prediction layers "
        "to train (num_nextn_predict_layers: 0)"
    )
