"""Prompt batches: exact order without shuffle, per-epoch permutations, exact resume."""

from __future__ import annotations

import itertools
import json

import pytest

from rltrain.data.loader import LoaderStateMismatch, PromptLoader
from rltrain.data.prompt_rows import DataRowError, PromptExample


def make_dataset(n: int) -> list[PromptExample]:
    return [
        PromptExample(
            index=i,
            prompt=f"p{i}",
            ground_truth=str(i),
            data_source="arithmetic",
            extra_info={},
            origin=f"f:{i + 1}",
        )
        for i in range(n)
    ]


def take(loader: PromptLoader, num_batches: int) -> list[list[int]]:
    return [loader.next_batch().indices for _ in range(num_batches)]


def flat(batches: list[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(batches))


def test_sequential_order_drop_last_and_partial_batch() -> None:
    loader = PromptLoader(make_dataset(7), 3, seed=0, shuffle=False)
    assert len(loader) == 2
    assert [b.indices for b in loader] == [[0, 1, 2], [3, 4, 5]]
    assert [b.indices for b in loader] == [[0, 1, 2], [3, 4, 5]]  # second epoch
    assert loader.epoch == 1
    keep = PromptLoader(make_dataset(7), 3, seed=0, shuffle=False, drop_last=False)
    assert len(keep) == 3
    batches = list(keep)
    assert [b.indices for b in batches] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [(b.epoch, b.position) for b in batches] == [(0, 0), (0, 1), (0, 2)]
    assert batches[2].ground_truths == ["6"] and batches[2].data_sources == ["arithmetic"]


def test_each_epoch_is_a_seeded_permutation() -> None:
    loader = PromptLoader(make_dataset(12), 4, seed=5)
    epochs = [flat(take(loader, 3)) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(12))
    assert epochs[0] != epochs[1] != epochs[2]
    again = PromptLoader(make_dataset(12), 4, seed=5)
    assert flat(take(again, 9)) == flat(epochs)
    other = PromptLoader(make_dataset(12), 4, seed=6)
    assert flat(take(other, 3)) != epochs[0]


@pytest.mark.parametrize("cut", [0, 1, 2, 3, 4, 7])
def test_resume_yields_the_uninterrupted_batches(cut: int) -> None:
    reference = take(PromptLoader(make_dataset(10), 3, seed=11), 12)  # 3 batches/epoch, 4 epochs
    first = PromptLoader(make_dataset(10), 3, seed=11)
    seen = take(first, cut)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
    resumed = PromptLoader(make_dataset(10), 3, seed=11)
    resumed.load_state_dict(state)
    assert seen + take(resumed, 12 - cut) == reference


def test_resume_with_epoch_iteration() -> None:
    loader = PromptLoader(make_dataset(9), 2, seed=1)
    reference = []
    ref_loader = PromptLoader(make_dataset(9), 2, seed=1)
    for _ in range(2):
        reference += [b.indices for b in ref_loader]
    iterator = iter(loader)
    seen = [next(iterator).indices, next(iterator).indices]
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (0, 2)
    resumed = PromptLoader(make_dataset(9), 2, seed=1)
    resumed.load_state_dict(state)
    rest = [b.indices for b in resumed]
    rest += [b.indices for b in resumed]
    assert seen + rest == reference


@pytest.mark.parametrize(("old", "new"), [(4, 2), (2, 4), (4, 3), (3, 5)])
def test_a_new_batch_size_resumes_at_the_same_prompt(old: int, new: int) -> None:
    """Resumed with another ``data.train_batch_size``, the run goes on from the prompt it stopped at,
    in the same epoch order, in batches of the new size (an epoch's tail shorter than one batch is
    dropped, as always with drop_last)."""
    first = PromptLoader(make_dataset(13), old, seed=7)
    seen = flat(take(first, 2))
    state = json.loads(json.dumps(first.state_dict()))
    resumed = PromptLoader(make_dataset(13), new, seed=7)
    resumed.load_state_dict(state)
    order = resumed.epoch_order(0)
    assert seen == order[: 2 * old]
    rest_of_epoch = (13 - 2 * old) // new
    got = take(resumed, rest_of_epoch)
    assert got == [order[2 * old + i * new : 2 * old + (i + 1) * new] for i in range(rest_of_epoch)]
    assert [b.epoch for b in [resumed.next_batch()]] == [1]  # the next epoch starts from its first prompt
    assert resumed.state_dict()["offset"] == new and resumed.state_dict()["epoch"] == 1
    assert take(resumed, 1) == [resumed.epoch_order(1)[new : 2 * new]]


def test_a_state_saved_before_offsets_existed_resumes_at_its_position() -> None:
    state = {k: v for k, v in PromptLoader(make_dataset(10), 3, seed=1).state_dict().items() if k != "offset"}
    state["position"] = 2
    resumed = PromptLoader(make_dataset(10), 2, seed=1)
    resumed.load_state_dict(state)
    assert take(resumed, 1) == [resumed.epoch_order(0)[6:8]]


def test_state_mismatch_is_refused_naming_the_field() -> None:
    state = PromptLoader(make_dataset(10), 2, seed=1).state_dict()
    with pytest.raises(
        LoaderStateMismatch,
        match=r"^the data order was saved with 10 training prompts, this run has 9 \(data\.train_files",
    ):
        PromptLoader(make_dataset(9), 2, seed=1).load_state_dict(state)
    with pytest.raises(
        LoaderStateMismatch, match=r"^the data order was saved with data\.seed=1, this run has data\.seed=2"
    ):
        PromptLoader(make_dataset(10), 2, seed=2).load_state_dict(state)
    with pytest.raises(
        LoaderStateMismatch, match=r"^the data order was saved with data\.shuffle=True, this run has"
    ):
        PromptLoader(make_dataset(10), 2, seed=1, shuffle=False).load_state_dict(state)
    with pytest.raises(KeyError, match=r"lacks keys \['position'\]"):
        PromptLoader(make_dataset(10), 2, seed=1).load_state_dict(
            {k: v for k, v in state.items() if k != "position"}
        )
    with pytest.raises(ValueError, match="offset=18 is outside"):
        PromptLoader(make_dataset(10), 2, seed=1).load_state_dict({**state, "position": 9, "offset": 18})
    with pytest.raises(DataRowError, match=r"^3 prompts, fewer than one batch \(data.train_batch_size=4\)$"):
        PromptLoader(make_dataset(3), 4, seed=0)


def test_order_follows_the_documented_frozen_numpy_stream() -> None:
    import numpy as np

    loader = PromptLoader(make_dataset(8), 4, seed=3)
    for epoch in range(3):
        assert loader.epoch_order(epoch) == np.random.RandomState([3, epoch]).permutation(8).tolist()
