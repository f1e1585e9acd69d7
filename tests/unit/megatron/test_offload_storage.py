"""Offload between phases parks each parameter's storage (``park_storages``) instead of giving the
parameter new ``.data``: the tensors stay the same objects, so the gradient-accumulator hooks through
which Megatron's DDP fills ``main_grad`` keep firing after a reload. On CUDA the old way (``.data``
moved to the CPU and back) dropped those hooks and every later step saw zero gradients (seen on an
H200 with the plain optimizer: grad norm 0.0 after a reload); the GPU test compares that step with
a run that never offloaded. Here, on CPU, the mechanism itself: bytes, sharing, hooks."""

from __future__ import annotations

import torch

from rltrain.megatron.worker import park_storages, unpark_storages


def test_parked_storage_is_released_and_comes_back_bit_exact_in_the_same_tensor() -> None:
    weight = torch.nn.Parameter(torch.tensor([[1.5, -2.0], [0.25, 3.0]], dtype=torch.bfloat16))
    bias = torch.nn.Parameter(torch.tensor([7.0, -1.0]))
    before = [weight.detach().clone(), bias.detach().clone()]
    parked = park_storages([weight.data, bias.data])
    assert len(parked) == 2
    assert weight.untyped_storage().nbytes() == 0 and bias.untyped_storage().nbytes() == 0
    assert [saved.numel() for _, saved in parked] == [4 * 2, 2 * 4]  # bytes: bf16 2×2, fp32 2
    unpark_storages(parked)
    assert torch.equal(weight.detach(), before[0]) and torch.equal(bias.detach(), before[1])


def test_views_of_one_flat_buffer_are_parked_once_and_all_come_back() -> None:
    flat = torch.arange(10.0)
    first, second = flat[:4].view(2, 2), flat[4:]
    parked = park_storages([first, second, flat])
    assert len(parked) == 1 and parked[0][1].numel() == 10 * 4
    assert flat.untyped_storage().nbytes() == 0
    unpark_storages(parked)
    assert first.tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert second.tolist() == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]


def test_gradient_accumulator_hooks_fire_after_a_park_and_unpark() -> None:
    """Megatron's DDP registers its hook on each parameter's gradient accumulator (the node
    ``param.expand_as(param)`` feeds); the hook must still add the gradient into main_grad."""
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    param.main_grad = torch.zeros(3)
    accumulator = param.expand_as(param).grad_fn.next_functions[0][0]

    def add_into_main_grad(*_):
        param.main_grad.add_(param.grad)
        param.grad = None

    accumulator.register_hook(add_into_main_grad)
    x = torch.tensor([0.5, -1.0, 2.0])
    (param * x).sum().backward()
    unpark_storages(park_storages([param.data]))
    (param * param * x).sum().backward()  # d/dp = 2·p·x = [1, -4, 12]
    assert param.main_grad.tolist() == [0.5 + 1.0, -1.0 - 4.0, 2.0 + 12.0]
    assert param.grad is None
