"""DAPO's dynamic sampling and overlong shaping (rltrain/trainer/dynamic_sampling.py) on
hand-built rounds: which groups go, how the batch is refilled and trimmed, the bound on rounds, the
padding of prompts of other widths, and the penalty against hand-computed values."""

import pytest
import torch

from rltrain.config.algorithm import FilterGroupsConfig
from rltrain.data.loader import PromptBatch
from rltrain.data.prompt_rows import PromptExample
from rltrain.data.step_batch import build_step_batch
from rltrain.trainer.dynamic_sampling import (
    DROPPED_GROUPS,
    GENERATED_PROMPTS,
    KEPT_GROUPS,
    KEPT_SCORE_MEAN,
    NUM_GEN_BATCHES,
    SURPLUS_GROUPS,
    DynamicSamplingExhausted,
    ScoredRound,
    fill_batch,
    overlong_penalty,
    round_seed,
    varying_groups,
)

N = 2
PAD = 0


def _round(tag: str, prompt_lens: list[int], correct: list[list[bool]], position: int = 0) -> ScoredRound:
    """Prompts ``{tag}{i}`` of the given lengths, N samples each; a sample's response is one token
    holding its global number, its score 1.0 when correct, else 0.25."""
    examples = [
        PromptExample(
            index=i,
            prompt=f"{tag}{i}",
            ground_truth=f"{tag}{i}",
            data_source="arithmetic",
            extra_info={},
            origin=f"{tag}:{i}",
            prompt_ids=list(range(1, length + 1)),
        )
        for i, length in enumerate(prompt_lens)
    ]
    prompts = PromptBatch(examples=examples, epoch=0, position=position)
    flat = [c for per_prompt in correct for c in per_prompt]
    batch = build_step_batch(
        prompt_ids=prompts.prompt_ids,
        response_ids=[[100 + k] for k in range(len(flat))],
        response_logprobs=[[-0.5] for _ in flat],
        finish_reasons=["stop"] * len(flat),
        n=N,
        data_sources=prompts.data_sources,
        ground_truths=prompts.ground_truths,
        pad_token_id=PAD,
        response_length=3,
    )
    batch.scores = torch.tensor([1.0 if c else 0.25 for c in flat])
    return ScoredRound(prompts, batch, torch.tensor(flat))


def _fill(first, rounds, *, metric="acc", size=3, max_rounds=0):
    asked = []

    def more(r: int) -> ScoredRound:
        asked.append(r)
        return rounds[r - 1]

    config = FilterGroupsConfig(enable=True, metric=metric, max_num_gen_batches=max_rounds)
    batch, prompts, metrics = fill_batch(
        first, more, config=config, train_batch_size=size, n=N, pad_token_id=PAD, step=7
    )
    return batch, prompts, metrics, asked


def test_constant_groups_are_dropped_and_the_batch_is_refilled_then_trimmed():
    # round 0: a0 all right, a1 mixed, a2 all wrong -> 1 kept; round 1: b0 mixed, b1 all wrong, b2 mixed
    # -> 3 kept, the batch is full: no round 2
    first = _round("a", [2, 2, 2], [[True, True], [True, False], [False, False]])
    second = _round("b", [4, 3, 2], [[False, True], [False, False], [True, False]], position=1)
    batch, prompts, metrics, asked = _fill(first, [second])
    assert asked == [1]
    assert [ex.prompt for ex in prompts.examples] == ["a1", "b0", "b2"]
    assert prompts.position == 1
    # samples of a1 (global 2, 3), b0 (0, 1), b2 (4, 5) of their rounds, in that order
    assert batch.response_ids[:, 0].tolist() == [102, 103, 100, 101, 104, 105]
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert batch.scores.tolist() == [1.0, 0.25, 0.25, 1.0, 1.0, 0.25]
    assert batch.ground_truths == ["a1", "a1", "b0", "b0", "b2", "b2"]
    # prompts left-padded to round 1's width 4: a1's two tokens sit at columns 2 and 3
    assert batch.input_ids[0].tolist() == [PAD, PAD, 1, 2, 102, PAD, PAD]
    assert batch.attention_mask[0].tolist() == [0, 0, 1, 1, 1, 0, 0]
    assert batch.input_ids[2].tolist() == [1, 2, 3, 4, 100, PAD, PAD]
    assert metrics == {
        NUM_GEN_BATCHES: 2.0,
        GENERATED_PROMPTS: 6.0,
        KEPT_GROUPS: 3.0,
        DROPPED_GROUPS: 3.0,
        SURPLUS_GROUPS: 0.0,
        KEPT_SCORE_MEAN: (1.0 + 0.25) / 2,
    }


def test_surplus_groups_are_cut_in_generation_order():
    first = _round("a", [2, 2, 2, 2], [[True, False], [False, True], [True, True], [True, False]])
    batch, prompts, metrics, asked = _fill(first, [], size=2)
    assert asked == [] and [ex.prompt for ex in prompts.examples] == ["a0", "a1"]
    assert metrics[KEPT_GROUPS] == 3.0 and metrics[SURPLUS_GROUPS] == 1.0 and metrics[DROPPED_GROUPS] == 1.0
    assert batch.batch_size == 4


def test_the_bound_on_rounds_is_respected_and_named():
    hard = [[False, False], [False, False], [True, False]]
    rounds = [_round(t, [2, 2, 2], hard) for t in "bcd"]
    with pytest.raises(DynamicSamplingExhausted) as err:
        _fill(_round("a", [2, 2, 2], hard), rounds, max_rounds=2)
    assert str(err.value).startswith(
        "step 7: 2 of data.train_batch_size=3 groups vary in 'acc' after 2 generation rounds "
        "(algorithm.filter_groups.max_num_gen_batches=2)"
    )
    # no bound: rounds go on until the batch is full (a, b, c: one kept each)
    _, prompts, metrics, asked = _fill(_round("a", [2, 2, 2], hard), rounds, max_rounds=0)
    assert asked == [1, 2] and metrics[NUM_GEN_BATCHES] == 3.0
    assert [ex.prompt for ex in prompts.examples] == ["a2", "b2", "c2"]


def test_the_metric_decides_what_must_vary():
    # both samples of a0 are wrong, but with different scores: kept under "score", dropped under "acc"
    first = _round("a", [2, 2], [[False, False], [True, False]])
    first.batch.scores = torch.tensor([0.0, 0.1, 1.0, 0.0])
    _, prompts, _, _ = _fill(first, [], metric="score", size=2)
    assert [ex.prompt for ex in prompts.examples] == ["a0", "a1"]
    with pytest.raises(DynamicSamplingExhausted):
        _fill(first, [], metric="acc", size=2, max_rounds=1)


def test_varying_groups_keeps_groups_of_one():
    values = torch.tensor([1.0, 1.0, 0.5, 0.0, 2.0])
    ids = torch.tensor([0, 0, 1, 1, 2])
    assert varying_groups(values, ids, 3).tolist() == [False, True, True]


def test_overlong_penalty_against_hand_values():
    # budget 10, buffer 4: free up to 6 tokens, then -1/4 * factor 0.5 per token: 7 -> -0.125, 10 -> -0.5
    lengths = torch.tensor([3, 6, 7, 9, 10])
    got = overlong_penalty(lengths, response_length=10, buffer_len=4, penalty_factor=0.5)
    assert got.tolist() == [0.0, 0.0, -0.125, -0.375, -0.5]


def test_round_seeds_differ_from_every_step_seed():
    # a step's first round keeps its seed (rollout.seed + step); no later round of the first 10k
    # steps reuses the seed of any of them, nor of another step's round
    assert round_seed(42 + 7, 0) == 42 + 7
    step_seeds = {42 + step for step in range(1, 10_001)}
    later = [round_seed(42 + step, r) for step in range(1, 10_001) for r in (1, 2, 3)]
    assert not step_seeds & set(later) and len(set(later)) == len(later)


def test_rounds_with_and_without_turn_rewards_or_sampled_masks_merge():
    # round 0 has an interaction's turn reward and a sampled mask with a gap; round 1 has neither
    first = _round("a", [2, 2], [[True, False], [True, True]])
    first.batch.turn_rewards = torch.zeros(4, 3)
    first.batch.turn_rewards[1, 0] = 0.5
    first.batch.sampled_mask = torch.tensor([[1, 0, 0], [1, 0, 0], [1, 0, 0], [0, 0, 0]])
    second = _round("b", [3], [[False, True]], position=1)
    batch, prompts, _, asked = _fill(first, [second], size=2)
    assert asked == [1] and [ex.prompt for ex in prompts.examples] == ["a0", "b0"]
    assert batch.turn_rewards.tolist() == [[0.0] * 3, [0.5, 0.0, 0.0], [0.0] * 3, [0.0] * 3]
    # round 1's samples keep every response token (one each) as sampled
    assert batch.sampled_mask.tolist() == [[1, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0]]
