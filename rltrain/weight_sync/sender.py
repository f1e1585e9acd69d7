"""``WeightSender``: the trainer side of one weight sync on one trainer rank, collective over the
trainer's ranks: the source of the weights (``PlannedExport``), the transport that moves them
(``transport.make_transport``), and the check that the engines hold exactly what was planned for
each of their workers (``rollout.weight_sync.verify_checksums``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from megatron_bridge.reshard import EngineLayout
from rltrain.logging import metrics as m
from rltrain.weight_sync.checksum import compare_digests, tensor_digest
from rltrain.weight_sync.transport import WeightTransport, make_transport
from rltrain.weight_sync.types import EngineReceiver, WeightSource, drain

log = logging.getLogger(__name__)


class WeightSender:
    """Moves ``source`` through ``transport`` at every ``sync``; ``host_ranks`` are the trainer ranks
    hosting a colocated engine (``engine`` on this rank when it is one of them; none when separate)."""

    def __init__(
        self,
        source: WeightSource,
        transport: WeightTransport,
        *,
        rank: int,
        host_ranks: list[int],
        engine: EngineReceiver | None,
        engine_tp: int,
        verify: bool,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.source, self.transport = source, transport
        self.rank, self.host_ranks, self.engine = rank, list(host_ranks), engine
        self.layout = EngineLayout(tp=engine_tp)
        self.verify_checksums, self.dtype = verify, dtype

    def sync(self) -> dict[str, float]:
        """Push the weights; the metrics come from the rank that reports the transport's stats."""
        start = time.perf_counter()
        stats = self.transport.send(self.source)
        metrics: dict[str, float] = {}
        if stats is not None:
            metrics = {
                m.WEIGHT_SYNC_SECONDS: time.perf_counter() - start,
                m.WEIGHT_SYNC_GBYTES: stats.num_bytes / 1e9,
                m.WEIGHT_SYNC_NUM_TENSORS: float(stats.num_tensors),
            }
        if self.verify_checksums and self.host_ranks:
            mismatched = self.verify()
            if stats is not None:
                metrics[m.WEIGHT_SYNC_CHECKSUM_MISMATCHES] = float(len(mismatched))
        return metrics

    def verify(self) -> list[str]:
        """Problems (one line each) where a colocated engine worker's effective weights differ from
        its planned shard (collective, like the sync; each engine's host reports its own)."""
        mismatched: list[str] = []
        for host in self.host_ranks:
            updates = self.source.regions(self.layout, dst=host)
            if host != self.rank:
                drain(updates)
                continue
            assert self.engine is not None
            engine = self.engine.all_weights_digests()
            expected: list[dict[str, str]] = [{} for _ in engine]
            for update in updates:
                for worker, digests in enumerate(expected):
                    if worker in update.regions and update.name in engine[worker]:
                        digests[update.name] = tensor_digest(update.shard(worker), self.dtype)
            for worker, (want, have) in enumerate(zip(expected, engine)):
                mismatched += [f"engine worker {worker}: {p}" for p in compare_digests(want, have)]
            for problem in mismatched:
                log.error("weight sync verification (rank %d): %s", self.rank, problem)
        return mismatched


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
) -> WeightSender:
    """The sender ``rollout.weight_sync`` (``sync_config``) and ``rollout.mode`` describe."""
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
    )
    return WeightSender(
        source,
        transport,
        rank=rank,
        host_ranks=host_ranks,
        engine=engine,
        engine_tp=engine_tp,
        verify=sync_config.verify_checksums,
        dtype=dtype,
    )
