"""Prompt batches over epochs with a reproducible, resumable order.

Contract: epoch ``e`` visits the dataset in the order ``epoch_order(e)``, a permutation drawn
from numpy's legacy ``RandomState([seed, epoch])`` (whose stream numpy keeps frozen across
versions) when ``shuffle`` is on, the file order otherwise. The loader's whole state is
``(epoch, position)``: the number of batches of the current epoch already handed out. Saving
``state_dict()`` after a step and loading it into a fresh loader over the same dataset yields
exactly the batches an uninterrupted run would have seen next; a state saved with another
dataset size, batch size, seed or shuffle/drop_last setting is refused, naming the field.

A dataset with fewer prompts than one batch is refused (:class:`~rltrain.data.dataset.DataRowError`
naming its files and ``data.train_batch_size``).

Two ways to iterate: ``for batch in loader`` yields the rest of the current epoch (a new epoch
starts on the next ``iter``), ``loader.next_batch()`` continues across epoch boundaries.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rltrain.data.dataset import DataRowError, PromptDataset, PromptExample


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
        self.position = 0
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

    def next_batch(self) -> PromptBatch:
        """The next batch, moving on to the next epoch when the current one is exhausted."""
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        positions = self.epoch_order(self.epoch)[start : start + self.batch_size]
        batch = PromptBatch([self.dataset[i] for i in positions], epoch=self.epoch, position=self.position)
        self.position += 1
        return batch

    def __iter__(self) -> Iterator[PromptBatch]:
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        while self.position < len(self):
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Position in the data order plus the settings that define the order."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "batch_size": self.batch_size,
            "num_examples": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the order-defining settings must match this loader's."""
        current = self.state_dict()
        missing = sorted(set(current) - set(state))
        if missing:
            raise KeyError(f"loader state lacks keys {missing}; has {sorted(state)}")
        for key in ("num_examples", "batch_size", "seed", "shuffle", "drop_last"):
            if state[key] != current[key]:
                raise ValueError(
                    f"loader state was saved with {key}={state[key]!r}, this loader has {key}={current[key]!r}"
                )
        if not 0 <= state["position"] <= len(self) or state["epoch"] < 0:
            raise ValueError(
                f"loader state epoch={state['epoch']} position={state['position']} is outside "
                f"0 <= position <= {len(self)} batches per epoch"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


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
