"""Automatic recovery: a worker that died or stopped answering restarts the run's workers, and the
run continues from its last good checkpoint (``trainer.max_restarts`` times at most).

Contract of :func:`fit_with_restarts`: it fits the first trainer; when that (or the first start of
the workers) raises a
:class:`WorkerLost` (a worker process that died, :class:`~rltrain.orchestrator.worker_group.WorkerDied`,
or did not answer within its ``trainer.timeouts`` bound, ``WorkerTimeout``) and restarts are left, it
says so in one line naming the role, the rank, the method and the cause, asks ``restart`` for a new
trainer (which kills every worker group, the engines they host with them, and starts them again the
way the run first did), resumes that trainer from the newest checkpoint that verifies and loads
(:meth:`~rltrain.trainer.driver.PPOTrainer.start` with ``recovering=True``; step 0 when the run
has saved none yet, said so), says in a second line which step it resumed from and how long the
recovery took, and trains on. A failure while restarting counts as another restart. With no
restarts left the failure is raised as it came (the run stops naming role and rank, as without
recovery). Any other error is never retried: a run stopped for its own reasons (divergence, a bad
checkpoint, a full disk) would stop again.

Every random choice of a step depends on (seed, step) only and the data position and KL controller
come from the checkpoint, so the steps after a recovery repeat those of an uninterrupted run. The
first step logged after each recovery carries :data:`RESTARTS` (restarts so far) and
:data:`RECOVER_SECONDS` (from the failure until training went on: teardown, start, checkpoint load,
weight sync); no other record changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rltrain.trainer.driver import MetricsSink, PPOTrainer, Progress

log = logging.getLogger(__name__)

RESTARTS = "trainer/restarts"
"""Metric: restarts of the run's workers so far (in the first step logged after each recovery)."""

RECOVER_SECONDS = "trainer/recover_seconds"
"""Metric: seconds from a worker failure until training went on (in the same record)."""


class WorkerError(RuntimeError):
    """A worker method failed; names the role, rank and method."""

    def __init__(self, role: str, rank: int, method: str, detail: str) -> None:
        self.role, self.rank, self.method = role, rank, method
        super().__init__(f"{role} rank {rank}: {method} failed: {detail}")


class WorkerLost(RuntimeError):
    """A worker process died or stopped answering: what ``trainer.max_restarts`` recovers from.

    Subclasses (in :mod:`~rltrain.orchestrator.worker_group`) carry ``role``, ``rank``, ``method``
    and a short ``cause``."""

    role: str
    rank: int
    method: str
    cause: str


class RestartMetrics:
    """A metrics sink that adds the restart metrics to the next record it passes on."""

    def __init__(self, sink: MetricsSink) -> None:
        self.sink = sink
        self.pending: dict[str, float] = {}

    def log(self, metrics: Mapping[str, float], *, step: int) -> None:
        if self.pending:
            metrics = {**metrics, **self.pending}
            self.pending = {}
        self.sink.log(metrics, step=step)


def describe(err: WorkerLost) -> str:
    """``critic rank 0 (update_critic): the worker process died (ActorDiedError)``."""
    return f"{err.role} rank {err.rank} ({err.method}): {err.cause}"


def fit_with_restarts(
    first: PPOTrainer | WorkerLost,
    *,
    restart: Callable[[], PPOTrainer],
    max_restarts: int,
    restart_metrics: RestartMetrics,
    progress: Progress | None = None,
) -> int:
    """Fit ``first``; after each :class:`WorkerLost`, ``restart()`` and go on (see the module doc).

    ``first``: the trainer over the roles as first started, or the failure that stopped their start
    (the first failure). ``restart_metrics`` must be the sink the trainers log to. Returns the last
    step."""
    trainer, failure = (None, first) if isinstance(first, WorkerLost) else (first, None)
    restarts, failed_at = 0, 0.0
    while True:
        if failure is not None:
            if restarts >= max_restarts:
                raise failure
            restarts += 1
            failed_at = time.monotonic()
            log.warning(
                "%s: restarting every worker group and resuming from the last good checkpoint "
                "(restart %d of %d, trainer.max_restarts)",
                describe(failure),
                restarts,
                max_restarts,
            )
            logging.getLogger().info("the failure in full:", exc_info=failure)  # the run's log file only
        try:
            if failure is None:
                step = trainer.start()
            else:
                trainer = restart()
                step = trainer.start(recovering=True)
                seconds = time.monotonic() - failed_at
                restart_metrics.pending = {RESTARTS: float(restarts), RECOVER_SECONDS: seconds}
                resumed = (
                    f"resumed from step {step}" if step else "no checkpoint yet: started again from step 0"
                )
                log.warning(
                    "restart %d of %d: %s, %.1f s after the failure", restarts, max_restarts, resumed, seconds
                )
                _rewind(progress, step)
                failure = None
            return trainer.train_from(step, progress=progress)
        except WorkerLost as err:
            failure = err


def _rewind(progress: Progress | None, step: int) -> None:
    """Put a progress display that can go back (``StepProgress.rewind``) at ``step``."""
    rewind = getattr(progress, "rewind", None)
    if rewind is not None:
        rewind(step)
