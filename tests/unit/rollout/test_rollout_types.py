"""``RolloutOutput.from_samples`` against hand-built outputs."""

import pytest

from rltrain.rollout.types import RolloutOutput, Sample


def test_from_samples_lays_samples_out_prompt_by_prompt():
    a0, a1 = Sample([5, 6], [-0.5, -1.0], "length", None), Sample([7], [-0.25], "stop", 7)
    b0, b1 = Sample([8, 2], [-2.0, -0.125], "stop", "ab"), Sample([9, 9], [-1.5, -1.5], "length", None)
    out = RolloutOutput.from_samples([[1, 2], [3]], [[a0, a1], [b0, b1]], n=2)
    assert out == RolloutOutput(
        prompt_ids=[[1, 2], [3]],
        response_ids=[[5, 6], [7], [8, 2], [9, 9]],
        response_logprobs=[[-0.5, -1.0], [-0.25], [-2.0, -0.125], [-1.5, -1.5]],
        finish_reasons=["length", "stop", "stop", "length"],
        n=2,
        stop_reasons=[None, 7, "ab", None],
    )
    assert out.sample_prompt_ids(3) == [3]


def test_from_samples_refuses_a_prompt_without_n_samples():
    sample = Sample([5], [-0.5], "length", None)
    with pytest.raises(ValueError, match=r"2 prompts need 2 samples each, got \[2, 1\]"):
        RolloutOutput.from_samples([[1], [2]], [[sample, sample], [sample]], n=2)
