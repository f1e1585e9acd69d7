"""Nothing of a run outlives its driver, whatever ends the driver (SIGKILL included).

Contract: :func:`reaped_run` marks the driver's environment with :data:`RUN_MARK_ENV` (a token of
this run) before anything starts, so that every process the run starts inherits it: a private Ray
instance's daemons (GCS, raylet, dashboard and runtime-env agents) and workers, the engines those
start, sandboxes. It also starts this module as a watcher in a session of its own (a terminal's
Ctrl-C does not reach it), unmarked, holding a pipe from the driver. When the pipe closes (the run
ended and the driver closed it, or the driver died and the kernel closed it) or the watcher's parent
changes (the driver died while a forked child still holds the pipe), the watcher kills every process
whose environment carries the token, until none is left, and exits.

Why: Ray stops its GCS and raylet with a driver that dies, but the agents the raylet started first
try for 60 s to report the raylet's death to the dead GCS (about 62 s in all on Ray 2.60), and a
worker stuck in a system call may linger too. The watcher reads ``/proc`` (Linux); elsewhere it
only waits for its parent and kills nothing. Imports nothing beyond the standard library, so that
it starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

RUN_MARK_ENV = "RLTRAIN_RUN_MARK"
"""The environment variable whose value marks every process of one run."""

POLL_S = 0.25
"""How often the watcher checks that its parent (the driver) is still its parent."""


@contextlib.contextmanager
def reaped_run() -> Iterator[str]:
    """Mark this process's environment for the run and watch it; yields the run's token. On exit the
    mark is taken back (a driver that goes on, e.g. a test, starts unmarked processes again) and the
    watcher is told to kill what is left of the run."""
    token = uuid.uuid4().hex
    previous = os.environ.get(RUN_MARK_ENV)
    env = {k: v for k, v in os.environ.items() if k != RUN_MARK_ENV}
    watcher = subprocess.Popen(
        [sys.executable, "-m", __name__, token],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    os.environ[RUN_MARK_ENV] = token
    try:
        yield token
    finally:
        if previous is None:
            os.environ.pop(RUN_MARK_ENV, None)
        else:
            os.environ[RUN_MARK_ENV] = previous
        watcher.stdin.close()  # the watcher reaps what is left and exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            watcher.wait(timeout=10)


def marked_processes(token: str, *, proc: Path = Path("/proc")) -> list[int]:
    """The ids of the processes whose environment holds ``RLTRAIN_RUN_MARK=<token>`` (not this one)."""
    needle = f"{RUN_MARK_ENV}={token}".encode()
    found = []
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def kill_marked(token: str, *, rounds: int = 20) -> int:
    """SIGKILL every process of the run until none is left (a dying parent may start one more), at most
    ``rounds`` times; returns how many were killed."""
    killed = 0
    for _ in range(rounds):
        pids = marked_processes(token)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.05)
    return killed


def watch(token: str) -> None:
    """Wait for the driver's end (EOF on stdin, or a new parent), then kill the run's processes."""
    driver = os.getppid()
    stdin = sys.stdin.buffer
    while os.getppid() == driver:
        ready, _, _ = select.select([stdin], [], [], POLL_S)
        if ready and not stdin.read1(4096):
            break
    kill_marked(token)


if __name__ == "__main__":
    watch(sys.argv[1])
