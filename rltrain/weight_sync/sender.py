"""``WeightSender``: the trainer side of one weight sync on one trainer rank, collective over the
trainer's ranks: the source of the weights (``PlannedExport``), the transport that moves them
(``transport.make_transport``), and the check that the engines hold exactly what was planned for
each of their workers (``rollout.weight_sync.verify_checksums``).

Verification of a colocated engine (an engine on other devices checks itself on receipt, the same
way: ``rltrain.workers.rollout_worker``; both use ``verify.EngineCheck``):
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
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_bridge.reshard import EngineLayout
from rltrain.errors import WeightSyncMismatchError
from rltrain.logging import metrics as m
from rltrain.weight_sync.transport import WeightTransport, make_transport
from rltrain.weight_sync.types import EngineReceiver, TensorRegions, WeightSource, drain
from rltrain.weight_sync.verify import Digester, EngineCheck

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
        self.check = EngineCheck(
            verify=verify,
            every=verify_every,
            dtype=dtype,
            where=f"the engine of trainer rank {rank}",
            sender=rank,
        )
        """This rank's engine's verification (``verify.EngineCheck``)."""

    def sync(self, index: int | None = None) -> dict[str, float]:
        """Push the weights and verify them; the metrics come from the rank that reports the
        transport's stats. Raises ``WeightSyncMismatchError`` on every rank on a mismatch.
        ``index``: what the sampled verification rotates by, the training step whose weights these
        are (None: this sender's count of syncs); its first sync is checked whole whatever it is."""
        digester = self.check.digester(index) if self.host_ranks else None
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
        self.check.num_syncs += 1
        return metrics

    def verify(self) -> list[str]:
        """Problems (one line each) where a colocated engine worker's effective weights differ from
        its planned shard, every tensor whole (collective: streams the weights again; each engine's
        host reports its own). For debugging and tests; ``sync`` verifies as configured."""
        digester = self.check.digester(None, mode="full")
        for host in self.host_ranks:
            drain(_TappedSource(self.source, digester).regions(self.layout, dst=host))
        return self._compare(digester)[0]

    def _compare(self, digester: Digester) -> tuple[list[str], int]:
        """This rank's problems (its engine against what it received) and the tensors verified."""
        return self.check.compare(self.engine, digester)

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


class _TappedSource:
    """``source`` whose streams pass through ``digester.tap``."""

    def __init__(self, source: WeightSource, digester: Digester | None) -> None:
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
        fanout=sync_config.fanout,
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
