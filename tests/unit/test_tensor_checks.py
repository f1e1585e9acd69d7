"""global_max_abs on hand-made tensors in a gloo world of one: the largest magnitude wherever it sits
(a negative element, a bf16 tensor), NaN and either infinity read as infinite, empty tensors ignored."""

from __future__ import annotations

import math

import torch

from rltrain.tensor_checks import first_non_finite, global_max_abs


def named(*tensors: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(f"t{i}", t) for i, t in enumerate(tensors)]


def test_global_max_abs_finds_the_largest_magnitude(gloo_world_of_one) -> None:
    cpu = torch.device("cpu")
    assert global_max_abs([], device=cpu) == 0.0
    tensors = (
        torch.tensor([0.5, -2.0]),
        torch.empty(0),
        torch.tensor([[1.0, -7.25], [3.0, 0.0]]),
        torch.tensor([6.0], dtype=torch.bfloat16),
    )
    assert global_max_abs(named(*tensors), device=cpu) == 7.25
    assert global_max_abs(named(torch.tensor([-1.5, -0.5])), device=cpu) == 1.5
    for bad in (float("nan"), math.inf, -math.inf):
        t = torch.tensor([1.0, bad, 2.0])
        assert global_max_abs(named(torch.ones(3), t), device=cpu) == math.inf
        assert first_non_finite(named(torch.ones(3), t)) == (0, "t1")
