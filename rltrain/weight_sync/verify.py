"""Checking an engine after a sync: digests of what it was handed, taken while the regions pass by,
against what its workers read back (``rollout.weight_sync.verify_checksums``; which tensors and
columns a sync checks: ``rltrain.weight_sync.sampling``).

- ``Digester``: for one sync, taps the stream of ``TensorRegions`` an engine is handed and digests,
  per worker, the regions that sync checks; ``request()`` is what the engine then reads back.
- ``EngineCheck``: one engine's verification across syncs (its count of syncs, so that its first
  is checked whole; one info line about tensors it cannot read back). ``compare`` returns the
  problems, one line each, naming the HF tensor, the engine rank (TP worker), the engine (``where``)
  and the trainer rank(s) that sent the worker's regions.
Used on the trainer's host rank of a colocated engine (``sender.WeightSender``) and in a separate
engine's own process (``rltrain.workers.rollout_worker.RolloutWorker``). Pure torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from rltrain.weight_sync.checksum import tensor_digest
from rltrain.weight_sync.sampling import (
    DigestRequest,
    ModuleRotation,
    checked,
    last_width,
    sample_columns,
    take_columns,
    verify_mode,
)
from rltrain.weight_sync.types import EngineReceiver, SyncStats, TensorRegions

log = logging.getLogger(__name__)


class Digester:
    """Digests the regions one sync checks while they pass by (``tap``)."""

    def __init__(
        self, *, mode: str, sync_index: int, first: bool, every: int, dtype: torch.dtype | None, sender: int
    ) -> None:
        self.sync_index, self.first, self.every, self.mode = sync_index, first, every, mode
        self.dtype = dtype
        self.sender = sender
        """The trainer rank named for regions whose ``TensorRegions.senders`` is empty."""
        self.tensors: dict[str, bool] = {}
        """``{hf_name: sampled}`` of the tensors checked (``DigestRequest.tensors``)."""
        self.expected: dict[int, dict[str, str]] = {}
        """``{worker: {hf_name: digest}}`` of what the engine was handed."""
        self.senders: dict[tuple[str, int], list[int]] = {}
        """``{(hf_name, worker): [trainer rank]}``: who sent that worker's regions."""

    def tap(self, updates: Iterable[TensorRegions]) -> Iterator[TensorRegions]:
        rotation = ModuleRotation()
        for update in updates:
            position = rotation.position(update.name)
            sampled = checked(
                position, sync_index=self.sync_index, every=self.every, mode=self.mode, first=self.first
            )
            if sampled is not None:
                self.tensors[update.name] = sampled
                for worker in update.regions:
                    self.expected.setdefault(worker, {})[update.name] = self._digest(update, worker, sampled)
                    self.senders[update.name, worker] = update.senders.get(worker, [self.sender])
            yield update

    def _digest(self, update: TensorRegions, worker: int, sampled: bool) -> str:
        regions = update.regions[worker]
        shard = regions[0][1] if len(regions) == 1 else update.shard(worker)
        columns = sample_columns(update.name, self.sync_index, last_width(shard)) if sampled else None
        return tensor_digest(take_columns(shard, columns), self.dtype)

    def request(self) -> DigestRequest:
        return DigestRequest(self.sync_index, dict(self.tensors), skip_unsupported=self.mode == "sampled")


class EngineCheck:
    """The verification of one engine: ``verify`` (``sampled``, ``full``, ``off``; true: full,
    false: off) every ``every`` syncs; ``where`` names the engine in a problem's line."""

    def __init__(
        self, *, verify: str | bool, every: int, dtype: torch.dtype | None, where: str, sender: int = 0
    ) -> None:
        self.mode, self.every, self.dtype, self.where = verify_mode(verify), every, dtype, where
        self.sender = sender
        self.num_syncs = 0
        """Syncs checked so far (the first is checked whole)."""
        self._said_unverified = False

    def digester(self, index: int | None, *, mode: str | None = None) -> Digester | None:
        """The digester of the sync of step ``index`` (None: this check's count of syncs), or None
        when verification is off."""
        mode = mode or self.mode
        if mode == "off":
            return None
        return Digester(
            mode=mode,
            sync_index=self.num_syncs if index is None else index,
            first=self.num_syncs == 0,
            every=self.every,
            dtype=self.dtype,
            sender=self.sender,
        )

    def compare(self, engine: EngineReceiver | None, digester: Digester) -> tuple[list[str], int]:
        """The problems of ``engine`` against what ``digester`` saw it handed, and the tensors verified."""
        if engine is None or not digester.tensors:  # nothing checked at this sync (N > tensors)
            return [], 0
        have = engine.all_weights_digests(digester.request())
        problems, num_verified, unverified = [], 0, set()
        for worker, expected in digester.expected.items():
            for name, digest in expected.items():
                if name not in have[worker]:
                    unverified.add(name)
                    continue
                num_verified += 1
                if have[worker][name] != digest:
                    part = "sampled columns" if digester.tensors[name] else "whole shard"
                    senders = ", ".join(map(str, digester.senders[name, worker]))
                    problems.append(
                        f"weight sync verification failed: {name} on engine rank {worker} ({self.where}) "
                        f"differs from what trainer rank {senders} sent (sha256 of its {part}, sync "
                        f"{digester.sync_index})"
                    )
        if unverified and not self._said_unverified:
            log.info(
                "weight sync verification: %d tensors the engine does not read back are not verified "
                "(e.g. %s)",
                len(unverified),
                sorted(unverified)[0],
            )
            self._said_unverified = True
        for problem in problems:
            log.error("%s", problem)
        return problems, num_verified


class TappedEngine:
    """``engine`` whose ``receive`` streams pass through ``digester.tap`` first (a separate engine's
    transports hand it buckets; each is digested on its way in)."""

    def __init__(self, engine: EngineReceiver, digester: Digester | None) -> None:
        self.engine, self.digester = engine, digester
        self.num_workers = engine.num_workers

    def receive(self, updates: Iterable[TensorRegions], *, bucket_bytes: int) -> SyncStats:
        stream = self.digester.tap(updates) if self.digester is not None else updates
        return self.engine.receive(stream, bucket_bytes=bucket_bytes)
