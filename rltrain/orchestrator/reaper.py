"""Nothing of a run outlives its driver, whatever ends the driver (SIGKILL included).

Contract: :func:`reaped_run` marks the driver's environment with :data:`RUN_MARK_ENV` (a token of
this run) before anything starts, so that every process the run starts inherits it: a private Ray
instance's daemons (GCS, raylet, dashboard and runtime-env agents) and workers, the engines those
start, sandboxes. It also starts this module as a watcher in a session of its own (a terminal's
Ctrl-C does not reach it), unmarked, holding a pipe from the driver. When the pipe closes (the run
ended and the driver closed it, or the driver died and the kernel closed it) or the watcher's parent
changes (the driver died while a forked child still holds the pipe), the watcher kills every process
whose environment carries the token, until none is left, and exits. When the driver itself is gone
(not a run that ended in a driver that goes on), it first kills every process it saw below the
driver, born since the watcher started (``/proc`` scanned every half second): a process that renames
itself, as Ray's workers do, may overwrite the environment that ``/proc`` shows.

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

PROC = Path("/proc")

POLL_S = 0.5
"""How often the watcher checks that its parent (the driver) is still its parent, and notes the
processes below it."""


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


def marked_processes(token: str) -> list[int]:
    """The ids of the processes whose environment holds ``RLTRAIN_RUN_MARK=<token>`` (not this one)."""
    needle = f"{RUN_MARK_ENV}={token}".encode()
    found = []
    for entry in PROC.iterdir() if PROC.is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def kill_marked(token: str, *, rounds: int = 20) -> None:
    """SIGKILL every process of the run until none is left (a dying parent may start one more), at most
    ``rounds`` times."""
    for _ in range(rounds):
        pids = marked_processes(token)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _stat(pid: int | str) -> tuple[int, int] | None:
    """``(parent pid, start time in clock ticks)`` of a process, or None when it is gone."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every process below ``root``: pid -> start time (which tells a pid reused later)."""
    if not PROC.is_dir():
        return {}
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (stat := _stat(entry.name)) is not None:
            children.setdefault(stat[0], []).append((int(entry.name), stat[1]))
    found, todo = {}, [root]
    while todo:
        for pid, started in children.get(todo.pop(), []):
            if pid not in found:
                found[pid] = started
                todo.append(pid)
    return found


def kill_seen(seen: dict[int, int]) -> None:
    """SIGKILL the processes of ``seen`` still running with the same start time (not a reused pid)."""
    for pid, started in seen.items():
        stat = _stat(pid)
        if stat is not None and stat[1] == started and pid != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def watch(token: str) -> None:
    """Wait for the driver's end (EOF on stdin, or a new parent), then kill the run's processes: those
    carrying the token, and those seen below the driver meanwhile (a process that renames itself may
    overwrite the environment that ``/proc`` shows)."""
    driver = os.getppid()
    own = _stat(os.getpid())
    born_after = own[1] if own is not None else 0  # the driver's older children are not the run's
    stdin = sys.stdin.buffer
    seen: dict[int, int] = {}
    while os.getppid() == driver:
        seen.update({pid: t for pid, t in descendants(driver).items() if t >= born_after})
        ready, _, _ = select.select([stdin], [], [], POLL_S)
        if ready and not stdin.read1(4096):
            break
    # The pipe also closes when the driver dies, a moment before this process gets a new parent.
    deadline = time.monotonic() + POLL_S
    while os.getppid() == driver and time.monotonic() < deadline:
        time.sleep(0.02)
    if os.getppid() != driver:  # the driver is gone: everything started below it in the run goes
        seen.pop(os.getpid(), None)
        kill_seen(seen)
    kill_marked(token)


if __name__ == "__main__":
    watch(sys.argv[1])
