"""``WeightSender``: the trainer side of one weight sync on one trainer rank, collective over the
trainer's ranks: the source of the weights (``PlannedExport``), the transport that moves them
(``transport.make_transport``), and the check that the engines hold exactly what was planned for
each of their workers (``rollout.weight_sync.verify_checksums``).

Verification (colocated engines; engines on other devices are not verified):
- ``sampled`` (the default): which tensors and columns a sync checks comes from the sync index alone
  (the training step whose weights it carries; ``rltrain.weight_sync.sampling``): the first sync
  into an engine checks every tensor whole, later ones a
  rotating 1/``verify_every`` of the vLLM modules (all tensors of each) on a few columns each.
- ``full``: every tensor, whole, after every sync.
The trainer side digests the checked regions *during the sync's own stream*, on the host rank that
receives them (nothing is sent twice); the engine then reads back only the checked tensors and
columns (``RolloutEngine.all_weights_digests(request)``). A mismatch stops the run on every trainer
rank with :class:`~rltrain.errors.WeightSyncMismatchError`, naming the HF tensor, the engine rank
(its TP worker) and the trainer rank that sent the region. Tensors the engine cannot read back
(fused MoE other than GPT-OSS's stacked experts on CPU) are skipped in sampled mode, said once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_bridge.reshard import EngineLayout
from rltrain.errors import WeightSyncMismatchError
from rltrain.logging import metrics as m
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
from rltrain.weight_sync.transport import WeightTransport, make_transport
from rltrain.weight_sync.types import EngineReceiver, TensorRegions, WeightSource, drain

log = logging.getLogger(__name__)


class WeightSender:
    """Moves ``source`` through ``transport`` at every ``sync``; ``host_ranks`` are the trainer ranks
    hosting a colocated engine (``engine`` on this rank when it is one of them; none when separate).
    ``verify``: ``sampled``, ``full`` or ``off`` (true: full, false: off); ``verify_every``: the syncs
    within which sampled mode checks every tensor."""

    def __init__(
        self,
        source: WeightSource,
        transport: WeightTransport,
        *,
        rank: int,
        host_ranks: list[int],
        engine: EngineReceiver | None,
        engine_tp: int,
        verify: str | bool,
        verify_every: int = 32,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.source, self.transport = source, transport
        self.rank, self.host_ranks, self.engine = rank, list(host_ranks), engine
        self.layout = EngineLayout(tp=engine_tp)
        self.verify_mode, self.verify_every, self.dtype = verify_mode(verify), verify_every, dtype
        self.num_syncs = 0
        """Syncs done (the next one's index: what the sampled verification rotates by)."""
        self._said_unverified = False

    def sync(self, index: int | None = None) -> dict[str, float]:
        """Push the weights and verify them; the metrics come from the rank that reports the
        transport's stats. Raises ``WeightSyncMismatchError`` on every rank on a mismatch.
        ``index``: what the sampled verification rotates by, the training step whose weights these
        are (None: this sender's count of syncs); its first sync is checked whole whatever it is."""
        checking = self.verify_mode != "off" and bool(self.host_ranks)
        digester = _Digester(self, self.verify_mode, index) if checking else None
        start = time.perf_counter()
        stats = self.transport.send(_TappedSource(self.source, digester) if digester else self.source)
        metrics: dict[str, float] = {}
        if stats is not None:
            metrics = {
                m.WEIGHT_SYNC_SECONDS: time.perf_counter() - start,
                m.WEIGHT_SYNC_GBYTES: stats.num_bytes / 1e9,
                m.WEIGHT_SYNC_NUM_TENSORS: float(stats.num_tensors),
            }
        if digester is not None:
            start = time.perf_counter()
            problems, num_verified = self._compare(digester)
            self._stop_on(problems)
            if stats is not None:
                metrics[m.WEIGHT_SYNC_CHECKSUM_MISMATCHES] = 0.0
                metrics[m.WEIGHT_SYNC_VERIFY_SECONDS] = time.perf_counter() - start
                metrics[m.WEIGHT_SYNC_VERIFIED_TENSORS] = float(num_verified)
        self.num_syncs += 1
        return metrics

    def verify(self) -> list[str]:
        """Problems (one line each) where a colocated engine worker's effective weights differ from
        its planned shard, every tensor whole (collective: streams the weights again; each engine's
        host reports its own). For debugging and tests; ``sync`` verifies as configured."""
        digester = _Digester(self, "full")
        for host in self.host_ranks:
            drain(_TappedSource(self.source, digester).regions(self.layout, dst=host))
        return self._compare(digester)[0]

    def _compare(self, digester: _Digester) -> tuple[list[str], int]:
        """This rank's problems (its engine against what it received) and the tensors verified."""
        if self.engine is None or not digester.tensors:  # nothing checked at this sync (N > tensors)
            return [], 0
        have = self.engine.all_weights_digests(digester.request())
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
                        f"weight sync verification failed: {name} on engine rank {worker} (the engine "
                        f"of trainer rank {self.rank}) differs from what trainer rank {senders} sent "
                        f"(sha256 of its {part}, sync {digester.sync_index})"
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
            log.error("rank %d: %s", self.rank, problem)
        return problems, num_verified

    def _stop_on(self, problems: list[str]) -> None:
        """Raise on every trainer rank when any rank found a problem (one small gather per sync)."""
        everyone = [problems]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, problems)
        found = [p for rank_problems in everyone for p in rank_problems or []]
        if found:
            more = f" (and {len(found) - 1} more mismatches)" if len(found) > 1 else ""
            raise WeightSyncMismatchError(found[0] + more)


class _Digester:
    """Digests, on the rank receiving a stream, the regions one sync checks while they pass by."""

    def __init__(self, sender: WeightSender, mode: str, index: int | None = None) -> None:
        self.sync_index = sender.num_syncs if index is None else index
        self.first, self.every, self.mode = sender.num_syncs == 0, sender.verify_every, mode
        self.dtype, self.rank = sender.dtype, sender.rank
        self.tensors: dict[str, bool] = {}
        """``{hf_name: sampled}`` of the tensors checked (``DigestRequest.tensors``)."""
        self.expected: dict[int, dict[str, str]] = {}
        """``{worker: {hf_name: digest}}`` of the trainer's side."""
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
                    self.senders[update.name, worker] = update.senders.get(worker, [self.rank])
            yield update

    def _digest(self, update: TensorRegions, worker: int, sampled: bool) -> str:
        regions = update.regions[worker]
        shard = regions[0][1] if len(regions) == 1 else update.shard(worker)
        columns = sample_columns(update.name, self.sync_index, last_width(shard)) if sampled else None
        return tensor_digest(take_columns(shard, columns), self.dtype)

    def request(self) -> DigestRequest:
        return DigestRequest(self.sync_index, dict(self.tensors), skip_unsupported=self.mode == "sampled")


class _TappedSource:
    """``source`` whose streams pass through ``digester.tap``."""

    def __init__(self, source: WeightSource, digester: _Digester | None) -> None:
        self.source, self.digester = source, digester

    def regions(self, engine: EngineLayout, *, dst: int) -> Iterator[TensorRegions]:
        stream = self.source.regions(engine, dst=dst)
        return self.digester.tap(stream) if self.digester is not None else stream


def build_sender(
    source: WeightSource,
    *,
    sync_config: Any,
    mode: str,
    rank: int,
    host_ranks: list[int],
    engine_tp: int,
    engine: EngineReceiver | None = None,
    group: Any = None,
    device: Any = "cpu",
    dtype: torch.dtype | None = None,
    num_engines: int = 1,
) -> WeightSender:
    """The sender ``rollout.weight_sync`` (``sync_config``) and ``rollout.mode`` describe
    (``num_engines``: the separate engines)."""
    transport = make_transport(
        sync_config.transport,
        mode=mode,
        rank=rank,
        host_ranks=host_ranks,
        engine_tp=engine_tp,
        bucket_bytes=sync_config.bucket_size_mb << 20,
        engine=engine,
        group=group,
        device=device,
        num_engines=num_engines,
    )
    return WeightSender(
        source,
        transport,
        rank=rank,
        host_ranks=host_ranks,
        engine=engine,
        engine_tp=engine_tp,
        verify=sync_config.verify_checksums,
        verify_every=sync_config.verify_every,
        dtype=dtype,
    )
