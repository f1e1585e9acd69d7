"""StepBatch: padding layout from rollout output, slicing, data-parallel chunks."""

import torch

from rltrain.data.step_batch import StepBatch, build_step_batch


def make_batch() -> StepBatch:
    return build_step_batch(
        prompt_ids=[[5, 6, 7], [8]],
        response_ids=[[1, 2], [3], [4, 4, 4], [9]],
        response_logprobs=[[-0.1, -0.2], [-0.3], [-0.4, -0.5, -0.6], [-0.7]],
        finish_reasons=["stop", "stop", "length", "stop"],
        n=2,
        data_sources=["arithmetic", "gsm8k"],
        ground_truths=["3", "4"],
        pad_token_id=0,
        response_length=3,
    )


def test_layout_is_left_padded_prompt_then_right_padded_response():
    b = make_batch()
    assert b.input_ids.tolist() == [
        [5, 6, 7, 1, 2, 0],
        [5, 6, 7, 3, 0, 0],
        [0, 0, 8, 4, 4, 4],
        [0, 0, 8, 9, 0, 0],
    ]
    assert b.attention_mask.tolist() == [
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 1],
        [0, 0, 1, 1, 0, 0],
    ]
    assert b.response_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]]
    assert b.group_ids.tolist() == [0, 0, 1, 1]
    assert b.data_sources == ["arithmetic", "arithmetic", "gsm8k", "gsm8k"]
    assert b.ground_truths == ["3", "3", "4", "4"]
    torch.testing.assert_close(b.rollout_logprobs[2], torch.tensor([-0.4, -0.5, -0.6]))
    assert float(b.rollout_logprobs[1, 1:].abs().sum()) == 0.0
    assert b.num_response_tokens() == 7


def test_select_chunk_concat_round_trip():
    b = make_batch()
    b.scores = torch.tensor([1.0, 0.0, 0.5, 0.25])
    picked = b.select([3, 0])
    assert picked.input_ids.tolist() == [b.input_ids[3].tolist(), b.input_ids[0].tolist()]
    assert picked.scores.tolist() == [0.25, 1.0] and picked.finish_reasons == ["stop", "stop"]
    parts = b.chunk(2)
    assert [p.batch_size for p in parts] == [2, 2]
    back = StepBatch.concat(parts)
    assert torch.equal(back.input_ids, b.input_ids) and torch.equal(back.scores, b.scores)
    assert back.ground_truths == b.ground_truths and back.old_logprobs is None


def test_bad_rollout_output_is_named():
    import pytest

    with pytest.raises(ValueError, match=r"3 responses for 2 prompts × n=2"):
        build_step_batch(
            prompt_ids=[[1], [2]],
            response_ids=[[1], [2], [3]],
            response_logprobs=[[0.0]] * 3,
            finish_reasons=["stop"] * 3,
            n=2,
            data_sources=["a", "b"],
            ground_truths=["1", "2"],
            pad_token_id=0,
            response_length=4,
        )
    with pytest.raises(ValueError, match="does not split into 3"):
        make_batch().chunk(3)


def test_multi_turn_masks_and_turn_rewards_land_on_their_tokens():
    b = build_step_batch(
        prompt_ids=[[5, 6]],
        response_ids=[[1, 7, 7, 2], [3]],
        response_logprobs=[[-0.1, 0.0, 0.0, -0.2], [-0.3]],
        finish_reasons=["stop", "stop"],
        n=2,
        data_sources=["calc"],
        ground_truths=["3"],
        pad_token_id=0,
        response_length=5,
        sampled_masks=[[1, 0, 0, 1], [1]],
        turn_rewards=[[(0, 0.5), (3, 1.0)], []],
    )
    assert b.response_mask.tolist() == [[1, 0, 0, 1, 0], [1, 0, 0, 0, 0]]
    assert b.attention_mask[:, -5:].tolist() == [[1, 1, 1, 1, 0], [1, 0, 0, 0, 0]]
    assert b.turn_rewards.tolist() == [[0.5, 0, 0, 1.0, 0], [0, 0, 0, 0, 0]]
    assert b.select([1, 0]).response_mask.tolist() == [[1, 0, 0, 0, 0], [1, 0, 0, 1, 0]]
    assert b.num_response_tokens() == 3


def test_a_sampled_mask_of_the_wrong_length_is_refused():
    import pytest

    with pytest.raises(ValueError, match="sample 0: 2 tokens but a sampled mask of 1"):
        build_step_batch(
            prompt_ids=[[5]],
            response_ids=[[1, 2]],
            response_logprobs=[[-0.1, -0.2]],
            finish_reasons=["stop"],
            n=1,
            data_sources=["calc"],
            ground_truths=["3"],
            pad_token_id=0,
            response_length=3,
            sampled_masks=[[1]],
        )


def test_a_pickled_batch_comes_back_exactly_in_tensors_of_its_own() -> None:
    import pickle
    import warnings

    b = make_batch()
    b.scores = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64)
    b.old_logprobs = torch.randn(3, 4).t()  # not contiguous
    b.values = torch.randn(4, 3, dtype=torch.bfloat16)  # numpy has no bfloat16: torch pickles it
    b.routed_experts = torch.randint(0, 8, (4, 6, 2, 2), dtype=torch.int16)
    b.sampled_mask = b.response_mask.bool()
    b.extra_infos = [{"index": i} for i in range(4)]
    b.extra_metrics = {"prompt/overlong": 1.0}
    for protocol, out_of_band in ((4, False), (5, False), (5, True)):
        buffers: list = []
        data = pickle.dumps(b, protocol=protocol, buffer_callback=buffers.append if out_of_band else None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch warns when it wraps a read-only array
            # Out of band, as Ray passes arrays: the buffers are read-only memory.
            back = pickle.loads(data, buffers=[memoryview(bytes(x.raw())) for x in buffers])
        for name, value in vars(b).items():
            other = getattr(back, name)
            if isinstance(value, torch.Tensor):
                assert (
                    other.dtype == value.dtype and other.shape == value.shape and torch.equal(other, value)
                ), name
                # Writable, and its own memory: the sender's tensor is unchanged.
                other.logical_not_() if other.dtype == torch.bool else other.add_(1)
                assert not torch.equal(other, value), name
            else:
                assert other == value, name
        assert back.old_logprobs is not None and back.ref_logprobs is None
