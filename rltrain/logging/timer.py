"""Per-stage wall-clock timing of a training step.

Contract: ``with timer.stage("generate"): ...`` adds the seconds spent in the block to that stage
(also when the block raises); ``timer.metrics()`` returns ``{"timing_s/<stage>": seconds}`` for
the stages run since the last ``reset()``. Stage names are checked against a fixed list (by
default :data:`rltrain.logging.metrics.STAGES` plus ``step``) so a typo fails instead of opening a
new curve. Device work is asynchronous: pass ``sync`` (e.g. ``torch.cuda.synchronize``) to wait
for it at both ends of a stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from rltrain.logging.metrics import STAGES, timing_key


class StageTimer:
    """Accumulates seconds per named stage."""

    def __init__(
        self,
        *,
        stages: Sequence[str] = (*STAGES, "step"),
        clock: Callable[[], float] = time.perf_counter,
        sync: Callable[[], None] | None = None,
    ) -> None:
        self.stages = tuple(stages)
        self.clock = clock
        self.sync = sync
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the enclosed block under ``name``; repeated blocks of one stage add up."""
        if name not in self.stages:
            raise ValueError(f"unknown timing stage {name!r}; known: {list(self.stages)}")
        if self.sync is not None:
            self.sync()
        start = self.clock()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + (self.clock() - start)

    def metrics(self) -> dict[str, float]:
        """``timing_s/<stage>`` for every stage timed since the last reset, in stage order."""
        return {timing_key(name): self.seconds[name] for name in self.stages if name in self.seconds}

    def reset(self) -> None:
        self.seconds.clear()
