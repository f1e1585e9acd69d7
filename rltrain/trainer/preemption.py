"""Preemption: SIGTERM or SIGUSR1 stops the run at its next safe point, saved and resumable.

Contract: while :meth:`StopSignals.installed` is active (in the driver's main thread, from the
moment the run's Ray connection is up: Ray's own SIGTERM handler would stop the process at once),
SIGTERM and SIGUSR1 (what Slurm sends ahead of a time limit with ``--signal=USR1@N``) only record
that a stop was asked for; the handler does nothing else, so no save or collective is interrupted.
The driver asks :meth:`StopSignals.requested` after each step (its metrics logged, its scheduled
checkpoint written): on a request it saves the step if the schedule did not (whatever
``trainer.save_freq`` says), and the run ends with :class:`Preempted`, which the command line
turns into one line naming the checkpoint and how to resume, and exit code
:data:`PREEMPTED_EXIT_CODE`. A request before the first step stops there without a save (the run
resumes from where it started). A second signal changes nothing (said once the step is done;
two signals that arrive while the main thread is inside one C call reach the handler in
signal-number order, so SIGUSR1 is then named even if SIGTERM came first); a
save in progress goes on, and checkpoints are atomic, so even a SIGKILL then leaves ``latest`` on a
complete one. In the torchrun mode the ranks agree on the request (``agree``: a max over ranks), so
every rank stops after the same step.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75
"""Exit code of a run stopped by SIGTERM/SIGUSR1 after saving (``EX_TEMPFAIL``: try again later).
The Slurm script requeues the job on it; ``trainer.resume_mode: auto`` continues from the save."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """The run stopped on a signal at a safe point; ``checkpoint`` is where it resumes from (None
    before any checkpoint of the run existed)."""

    def __init__(self, *, signal_name: str, step: int, checkpoint: Path | None) -> None:
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        where = (
            f"its checkpoint is {checkpoint}"
            if checkpoint is not None
            else "no checkpoint yet: a resume starts from step 0"
        )
        super().__init__(f"stopped by {signal_name} after step {step}; {where}")


class StopSignals:
    """Records SIGTERM/SIGUSR1 while installed; see the module doc."""

    def __init__(self, *, agree: Callable[[int], int] | None = None) -> None:
        """``agree(signum)``: the signal number every rank settles on (0: none), for the torchrun
        mode; None in a single driver."""
        self.agree = agree
        self.signum = 0
        """The first stop signal received (0: none)."""
        self.count = 0
        """Stop signals received."""
        self._said = False

    @contextmanager
    def installed(self) -> Iterator[StopSignals]:
        """Handle the stop signals in this block (the main thread only; elsewhere, e.g. a test
        driving a run from a thread, the process keeps its handlers)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        # Only records: logging here could re-enter a write the main thread is in the middle of.
        self.count += 1
        self.signum = self.signum or signum

    def requested(self) -> str | None:
        """The name of the signal that asked the run to stop, or None (said once, when first seen)."""
        signum = self.agree(self.signum) if self.agree is not None else self.signum
        if not signum:
            return None
        name = signal.Signals(signum).name
        if not self._said:
            self._said = True
            log.warning("%s received: saving a checkpoint at this step's end, then stopping", name)
        return name
