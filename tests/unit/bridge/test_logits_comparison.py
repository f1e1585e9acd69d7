"""The conversion check's comparison of logits, on hand-made tensors: the tolerance from the rounding
noise, and a routed model's allowance for tokens whose expert choice flipped at a near-tie."""

import pytest
import torch

from megatron_bridge.verify import compare_against, routing_flips_allowed


def _tensors():
    reference = torch.zeros(2, 4, 3)
    wider = reference.clone()
    wider[0, 1, 2] = 0.01  # rounding noise 0.01: tolerance 1e-4 + 3 × 0.01
    ours = reference + 0.02
    return ours, reference, wider


def test_every_token_within_the_tolerance_passes_and_says_so_as_before():
    ours, reference, wider = _tensors()
    check = compare_against(ours, reference, wider, dtype=torch.bfloat16, atol=1e-4, flips_allowed=1)
    assert check.ok and check.tokens_beyond == 0
    assert check.max_abs_diff == pytest.approx(0.02) and check.tolerance == pytest.approx(0.0301)
    assert check.describe() == (
        "logits vs transformers, both in bfloat16 on 2×4 tokens: max abs diff 2.000e-02 <= tolerance "
        "3.010e-02 (atol 0.0001 + 3 × 1.000e-02, the most that running in bfloat16 instead of float32 "
        "moves transformers' own logits)"
    )


def test_one_flipped_token_passes_only_where_flips_are_allowed():
    ours, reference, wider = _tensors()
    ours[1, 3, 0] = 0.5
    strict = compare_against(ours, reference, wider, dtype=torch.bfloat16, atol=1e-4, flips_allowed=0)
    assert not strict.ok and strict.tokens_beyond == 1 and strict.max_abs_diff == pytest.approx(0.5)
    assert strict.describe().startswith(
        "logits vs transformers, both in bfloat16 on 2×4 tokens: max abs diff 5.000e-01 > tolerance 3.010e-02"
    )
    routed = compare_against(ours, reference, wider, dtype=torch.bfloat16, atol=1e-4, flips_allowed=1)
    assert routed.ok
    assert routed.describe().endswith(
        "; 1 of 8 tokens beyond it, at most 1 allowed (a routed model: a token whose top-k experts "
        "tie within rounding may take another expert in each implementation)"
    )
    ours[0, 0, 1] = -0.2
    two = compare_against(ours, reference, wider, dtype=torch.bfloat16, atol=1e-4, flips_allowed=1)
    assert not two.ok and two.tokens_beyond == 2
    assert "2 of 8 tokens beyond it, at most 1 allowed" in two.describe()


def test_fp64_reference_has_no_noise_and_the_atol_alone_holds():
    ours, reference, _ = _tensors()
    check = compare_against(ours, reference, None, dtype=torch.float64, atol=1e-4, flips_allowed=0)
    assert check.rounding_noise == 0 and check.tolerance == 1e-4 and not check.ok
    assert check.describe() == (
        "logits vs transformers, both in float64 on 2×4 tokens: max abs diff 2.000e-02 > atol 0.0001"
    )


def test_flips_are_allowed_on_one_percent_of_a_routed_models_tokens():
    assert routing_flips_allowed(num_experts=0, tokens=512) == 0  # dense: never
    assert routing_flips_allowed(num_experts=16, tokens=512) == 6  # ceil(5.12)
    assert routing_flips_allowed(num_experts=16, tokens=40) == 1  # at least one
