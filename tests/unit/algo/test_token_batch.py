"""TokenBatch: the response view and micro-batch slicing of every named loss input."""

from dataclasses import fields

import torch

from rltrain.algo.token_batch import LOSS_INPUTS, TokenBatch


def make_batch() -> TokenBatch:
    return TokenBatch(
        input_ids=torch.tensor([[0, 5, 1, 2], [6, 7, 3, 0], [0, 8, 4, 4]]),
        attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0], [0, 1, 1, 1]]),
        response_len=2,
        old_logprobs=torch.tensor([[-0.1, -0.2], [-0.3, 0.0], [-0.4, -0.5]]),
        advantages=torch.tensor([[1.0, 2.0], [3.0, 0.0], [5.0, 6.0]]),
    )


def test_response_mask_is_the_last_response_len_columns():
    batch = make_batch()
    assert batch.batch_size == 3
    assert batch.response_mask.tolist() == [[1, 1], [1, 0], [1, 1]]


def test_select_slices_rows_and_every_set_loss_input_in_the_given_order():
    part = make_batch().select([2, 0])
    assert part.input_ids.tolist() == [[0, 8, 4, 4], [0, 5, 1, 2]]
    assert part.attention_mask.tolist() == [[0, 1, 1, 1], [0, 1, 1, 1]]
    assert part.response_len == 2
    torch.testing.assert_close(part.old_logprobs, torch.tensor([[-0.4, -0.5], [-0.1, -0.2]]), rtol=0, atol=0)
    assert part.advantages.tolist() == [[5.0, 6.0], [1.0, 2.0]]
    assert part.ref_logprobs is None and part.rollout_logprobs is None
    assert part.values is None and part.returns is None


def test_loss_inputs_name_every_optional_field():
    optional = [f.name for f in fields(TokenBatch) if f.default is None]
    assert [*LOSS_INPUTS, "sampled_mask", "routed_experts"] == optional
    batch = make_batch()
    full = TokenBatch(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        response_len=2,
        **{name: torch.arange(6.0).view(3, 2) + 10 * i for i, name in enumerate(LOSS_INPUTS)},
    )
    part = full.select([1])
    for i, name in enumerate(LOSS_INPUTS):
        assert getattr(part, name).tolist() == [[2.0 + 10 * i, 3.0 + 10 * i]], name
    # routing replay's routes [batch, seq, layers, top_k] follow their rows too
    routes = torch.arange(3 * 4 * 2 * 2).view(3, 4, 2, 2)
    routed = TokenBatch(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, response_len=2, routed_experts=routes
    )
    assert torch.equal(routed.select([2, 0]).routed_experts, routes[[2, 0]])


def test_sampled_mask_replaces_the_response_mask_and_is_sliced_with_the_rows():
    batch = make_batch()
    gaps = torch.tensor([[1, 0], [0, 1], [1, 1]])
    with_gaps = TokenBatch(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, response_len=2, sampled_mask=gaps
    )
    assert with_gaps.response_mask.tolist() == [[1, 0], [0, 1], [1, 1]]
    assert with_gaps.select([1, 0]).response_mask.tolist() == [[0, 1], [1, 0]]
    assert batch.response_mask.tolist() == batch.attention_mask[:, -2:].tolist()


def test_to_moves_every_set_tensor_and_keeps_unset_fields_none():
    """The Megatron loss hook moves the micro-batch to the model output's device (CUDA on a GPU run);
    the meta device stands in for it here: every set field lands there, values unchanged on return."""
    batch = make_batch()
    assert batch.to(torch.device("cpu")) is batch  # nothing to move: the same batch
    moved = batch.to(torch.device("meta"))
    for name in ("input_ids", "attention_mask", "old_logprobs", "advantages"):
        assert getattr(moved, name).device.type == "meta", name
        assert getattr(batch, name).device.type == "cpu", name  # the original is not modified
    assert moved.ref_logprobs is None and moved.routed_experts is None and moved.response_len == 2
    back = make_batch().to("cpu")
    assert back.advantages.tolist() == [[1.0, 2.0], [3.0, 0.0], [5.0, 6.0]]
