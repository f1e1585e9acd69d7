"""Prompt batches over epochs with a reproducible, resumable order.

Contract: epoch ``e`` visits the dataset in the order ``epoch_order(e)``, a permutation drawn
from numpy's legacy ``RandomState([seed, epoch])`` (whose stream numpy keeps frozen across
versions) when ``shuffle`` is on, the file order otherwise. The loader's whole state is
``(epoch, offset)``: the number of prompts of the current epoch's order already handed out. Saving
``state_dict()`` after a step and loading it into a fresh loader over the same dataset yields
exactly the batches an uninterrupted run would have seen next. A loader with another batch size
(``data.train_batch_size`` changed between a save and the resume) goes on from the same prompt of
the same order, in batches of its own size; a state saved with another dataset size, seed or
shuffle/drop_last setting is refused (:class:`LoaderStateMismatch`, one line naming the key).

A dataset with fewer prompts than one batch is refused (:class:`~rltrain.data.prompt_rows.DataRowError`
naming its files and ``data.train_batch_size``).

Two ways to iterate: ``for batch in loader`` yields the rest of the current epoch (a new epoch
starts on the next ``iter``), ``loader.next_batch()`` continues across epoch boundaries.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rltrain.data.dataset import PromptDataset
from rltrain.data.prompt_rows import DataRowError, PromptExample

_ORDER_KEYS = {
    "num_examples": None,
    "seed": "data.seed",
    "shuffle": "data.shuffle",
    "drop_last": "drop_last",
}
"""The settings that define the data order, with the config key each comes from."""


class LoaderStateMismatch(ValueError):
    """A saved data position belongs to another data order (other prompts, seed or shuffle)."""


@dataclass
class PromptBatch:
    """One batch of prompts and where it sits in the data order."""

    examples: list[PromptExample]
    """[batch] the prompts, in loader order."""

    epoch: int
    """Epoch the batch belongs to, from 0."""

    position: int
    """Index of the batch within its epoch, from 0."""

    @property
    def prompt_ids(self) -> list[list[int]]:
        """[batch][prompt_len] token ids."""
        return [ex.prompt_ids for ex in self.examples]

    @property
    def ground_truths(self) -> list[str]:
        return [ex.ground_truth for ex in self.examples]

    @property
    def data_sources(self) -> list[str]:
        return [ex.data_source for ex in self.examples]

    @property
    def indices(self) -> list[int]:
        """Row indices of the prompts in the dataset's files."""
        return [ex.index for ex in self.examples]


class PromptLoader:
    """Seeded, epoch-aware, resumable batches of the training prompts (``data.train_batch_size`` each)."""

    def __init__(
        self,
        dataset: Sequence[PromptExample],
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise DataRowError(
                f"{_describe(dataset)}, fewer than one batch (data.train_batch_size={batch_size})"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.offset = 0
        """Prompts of this epoch's order handed out so far."""
        self.position = 0
        """Batches of this epoch handed out so far (counted in this loader's batch size after a resume
        with another one)."""
        self._order_cache: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def epoch_order(self, epoch: int) -> list[int]:
        """The order in which epoch ``epoch`` visits dataset positions."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            n = len(self.dataset)
            order = np.random.RandomState([self.seed, epoch]).permutation(n) if self.shuffle else range(n)
            self._order_cache = (epoch, [int(i) for i in order])
        return self._order_cache[1]

    def _epoch_has_a_batch(self) -> bool:
        """Whether the current epoch still holds a batch (a whole one with ``drop_last``)."""
        left = len(self.dataset) - self.offset
        return left >= self.batch_size if self.drop_last else left > 0

    def _next_epoch_if_done(self) -> None:
        if not self._epoch_has_a_batch():
            self.epoch, self.offset, self.position = self.epoch + 1, 0, 0

    def next_batch(self) -> PromptBatch:
        """The next batch, moving on to the next epoch when the current one is exhausted."""
        self._next_epoch_if_done()
        positions = self.epoch_order(self.epoch)[self.offset : self.offset + self.batch_size]
        batch = PromptBatch([self.dataset[i] for i in positions], epoch=self.epoch, position=self.position)
        self.offset += len(positions)
        self.position += 1
        return batch

    def __iter__(self) -> Iterator[PromptBatch]:
        self._next_epoch_if_done()
        while self._epoch_has_a_batch():
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Position in the data order plus the settings that define the order."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "batch_size": self.batch_size,
            "num_examples": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the order-defining settings must match this loader's
        (:class:`LoaderStateMismatch` otherwise). A state saved with another batch size continues from
        the same prompt; one saved before offsets were recorded counts ``position`` batches of its
        ``batch_size``."""
        current = self.state_dict()
        missing = sorted({"epoch", "position", "batch_size", *_ORDER_KEYS} - set(state))
        if missing:
            raise KeyError(f"loader state lacks keys {missing}; has {sorted(state)}")
        for key, config_key in _ORDER_KEYS.items():
            if state[key] == current[key]:
                continue
            if config_key is None:
                raise LoaderStateMismatch(
                    f"the data order was saved with {state[key]} training prompts, this run has "
                    f"{current[key]} (data.train_files, data.generated or data.max_prompt_length changed)"
                )
            raise LoaderStateMismatch(
                f"the data order was saved with {config_key}={state[key]!r}, this run has "
                f"{config_key}={current[key]!r}"
            )
        offset = state.get("offset", state["position"] * state["batch_size"])
        if not 0 <= offset <= len(self.dataset) or state["epoch"] < 0:
            raise ValueError(
                f"loader state epoch={state['epoch']} offset={offset} is outside 0 <= offset <= "
                f"{len(self.dataset)} prompts per epoch"
            )
        same_size = state["batch_size"] == self.batch_size
        self.epoch, self.offset = int(state["epoch"]), int(offset)
        self.position = int(state["position"]) if same_size else -(-self.offset // self.batch_size)


def _describe(dataset: Sequence[PromptExample]) -> str:
    """``files: N prompts`` and, if some were dropped, why."""
    if not isinstance(dataset, PromptDataset):
        return f"{len(dataset)} prompts"
    dropped = (
        f" ({dataset.num_filtered} longer than data.max_prompt_length dropped)"
        if dataset.num_filtered
        else ""
    )
    return f"{dataset.name}: {len(dataset)} prompts{dropped}"
