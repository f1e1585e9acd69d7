"""What a run prints: rltrain's own lines on the terminal, everything else in the run's log file.

Contract, for the processes of ``rltrain train`` and ``python -m rltrain.train`` (each torchrun rank):

* :func:`start_console` (first thing, before any heavy import) shows the records of the ``rltrain``
  loggers on the terminal as ``rltrain: message`` (``rltrain: WARNING: message`` above INFO; torchrun
  ranks other than 0 show warnings only), and reports an uncaught exception there with its traceback.
* :func:`capture_run_output` (once the run directory is known) sends everything else to
  :func:`log_path` (``<run dir>/rltrain.log``; ``rltrain.rank<r>.log`` for torchrun rank r > 0): log
  records of every library at INFO and above, Python warnings, whatever is written to stdout or
  stderr (by Python or by C code, through file descriptors 1 and 2), and the output of Ray's worker
  processes, which Ray forwards to the driver's ``sys.stdout``/``sys.stderr``. The terminal keeps
  rltrain's records, the progress bar and the step lines (written to :func:`terminal`), and the
  warnings and errors of rltrain's loggers inside Ray workers (lines in :data:`WORKER_LOG_FORMAT`).
  ``verbose=True`` (``--verbose``, ``trainer.verbose``) shows everything on the terminal as well;
  output that bypasses Python (C code) then reaches the terminal only.
* :func:`stage` brackets a slow step with ``rltrain: <what> ...`` and ``rltrain: <what> ... done in
  3.1 s``.
* :func:`configure_worker_logging` (each Ray worker process, at start) writes log records at INFO
  (rltrain's at :data:`TRACE` too) and Python warnings to the worker's stderr in
  :data:`WORKER_LOG_FORMAT`.
* Records of rltrain's loggers at :data:`TRACE` (the per-sample lines of
  :mod:`rltrain.logging.samples`) reach the log file only: the terminal shows rltrain's records from
  INFO up, ``verbose`` included, and a forwarded worker line only when it is a warning or an error
  (``verbose`` shows all of a worker's output, its TRACE lines too).

Without these calls (library use, tests calling ``train()``) logging is left as the caller set it
and :func:`terminal` is ``sys.stdout``/``sys.stderr``.
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TextIO

TRACE = 15
"""Level of the per-sample lines (between DEBUG and INFO): the run's log file, never the terminal."""

logging.addLevelName(TRACE, "TRACE")

LOG_FILE = "rltrain.log"
"""The run's log file, in the run directory."""

FILE_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""Log records in the run's log file."""

WORKER_LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
"""Log records on a Ray worker's stderr (Ray adds the ``(<role> rank <r> pid=...)`` prefix)."""

_OWN_WORKER_LINE = re.compile(r"^\([^()]*\) (?:WARNING|ERROR|CRITICAL) rltrain(?:\.[\w.]+)?: ")
"""A forwarded worker line holding a warning or error of an rltrain logger."""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CONSOLE_HANDLER = "rltrain-console"
_WORKER_HANDLER = "rltrain-worker"

log = logging.getLogger("rltrain")


@dataclass(frozen=True)
class Terminal:
    """Where rltrain's own output goes."""

    out: TextIO
    """Step lines (the metrics of each step)."""

    err: TextIO
    """Status lines, rltrain's log records and the progress bar."""


def log_path(run_dir: str | Path, rank: int = 0) -> Path:
    """The log file of ``run_dir`` written by (torchrun) rank ``rank``."""
    return Path(run_dir) / (LOG_FILE if rank == 0 else f"rltrain.rank{rank}.log")


def is_own_worker_line(line: str) -> bool:
    """Whether a line Ray forwarded from a worker is a warning or error of an rltrain logger."""
    return _OWN_WORKER_LINE.match(_ANSI.sub("", line)) is not None


class _OwnFormatter(logging.Formatter):
    """``rltrain: message`` (``rltrain[rank r]:`` on torchrun ranks r > 0); the level is named above
    INFO."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.prefix = "rltrain" if rank == 0 else f"rltrain[rank {rank}]"

    def formatMessage(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno == logging.INFO else f"{record.levelname}: "
        return f"{self.prefix}: {level}{record.message}"


class _ConsoleHandler(logging.Handler):
    """Writes records to the terminal through ``tqdm.write``, so that a progress bar is not torn."""

    def __init__(self, terminal: Terminal, formatter: logging.Formatter) -> None:
        super().__init__()
        self.terminal = terminal
        self.setFormatter(formatter)

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.terminal.err)
            self.terminal.err.flush()
        except Exception:  # logging's own policy: report on stderr, never raise into the caller
            self.handleError(record)


def _own_handler() -> _ConsoleHandler | None:
    for handler in log.handlers:
        if handler.get_name() == _CONSOLE_HANDLER and isinstance(handler, _ConsoleHandler):
            return handler
    return None


def terminal() -> Terminal:
    """The terminal of this process (``sys.stdout``/``sys.stderr`` unless :func:`capture_run_output`
    moved them into the log file)."""
    handler = _own_handler()
    return handler.terminal if handler is not None else Terminal(sys.stdout, sys.stderr)


def start_console(*, rank: int = 0) -> None:
    """Show rltrain's records on the terminal; this process's logging is set up here from now on."""
    root = logging.getLogger()
    for handler in list(root.handlers):  # e.g. the CLI's basicConfig: records would show twice
        root.removeHandler(handler)
    previous = _own_handler()
    if previous is not None:
        log.removeHandler(previous)
    handler = _ConsoleHandler(Terminal(sys.stdout, sys.stderr), _OwnFormatter(rank))
    handler.set_name(_CONSOLE_HANDLER)
    handler.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.addHandler(handler)
    log.setLevel(TRACE)  # made, for the log file; the handler above keeps them off the terminal
    sys.excepthook = _report_uncaught


def _report_uncaught(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        log.error("interrupted")
    else:
        log.critical("stopped by an error:", exc_info=(exc_type, exc, tb))


class _RunLog:
    """The log file, shared by the log handler and the stdout/stderr routers (one lock)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.stream = path.open("a", encoding="utf-8", buffering=1)
        self.lock = threading.RLock()

    def write(self, text: str) -> None:
        with self.lock:
            self.stream.write(text)
            self.stream.flush()


class _FileHandler(logging.Handler):
    def __init__(self, run_log: _RunLog) -> None:
        super().__init__()
        self.run_log = run_log
        self.setFormatter(logging.Formatter(FILE_LOG_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.run_log.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


class _Router(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` of a run: every line to the log file, the lines ``show`` picks
    also to ``terminal`` (``show=None``: all text to both, as written)."""

    def __init__(
        self, run_log: _RunLog, terminal: TextIO, *, show: Callable[[str], bool] | None, fileno: int
    ) -> None:
        super().__init__()
        self.run_log = run_log
        self.terminal = terminal
        self.show = show
        self._fileno = fileno
        self._pending = ""

    @property
    def encoding(self) -> str:
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fileno

    def write(self, text: str) -> int:
        with self.run_log.lock:
            if self.show is None:
                self.run_log.write(text)
                self.terminal.write(text)
                self.terminal.flush()
                return len(text)
            *lines, self._pending = (self._pending + text).split("\n")
            for line in lines:
                self.run_log.write(line + "\n")
                if self.show(line):
                    self.terminal.write(line + "\n")
                    self.terminal.flush()
        return len(text)

    def flush(self) -> None:
        with self.run_log.lock:
            self.run_log.stream.flush()
            self.terminal.flush()


def _one_stream_if_same_file(out: TextIO, err: TextIO) -> Terminal:
    """``Terminal(out, err)``, or ``err`` for both when the two name the same file (a terminal, or
    ``> out 2>&1``): tqdm clears a bar only for a write to the bar's own stream, and one stream keeps
    the order of lines."""
    if os.path.samestat(os.fstat(out.fileno()), os.fstat(err.fileno())):
        return Terminal(out=err, err=err)
    return Terminal(out=out, err=err)


def _detach_terminal() -> Terminal:
    """Streams on copies of file descriptors 1 and 2, which keep the terminal once 1 and 2 point at
    the log file."""
    out = open(os.dup(1), "w", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives with the process)
    err = open(os.dup(2), "w", buffering=1, encoding="utf-8")  # noqa: SIM115
    term = _one_stream_if_same_file(out, err)
    if term.out is not out:
        out.close()
    return term


def capture_run_output(path: str | Path, *, verbose: bool = False) -> Path:
    """Send third-party logs, warnings and output to ``path`` (see the module doc); returns it."""
    handler = _own_handler()
    if handler is None:
        raise RuntimeError("capture_run_output needs start_console() first (the terminal handler)")
    run_log = _RunLog(Path(path))
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(_FileHandler(run_log))
    logging.captureWarnings(True)
    # Ray colours the prefix of forwarded worker lines by default, escape codes and all.
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    sys.stdout.flush()
    sys.stderr.flush()
    if verbose:
        term = _one_stream_if_same_file(sys.stdout, sys.stderr)
        others = _ConsoleHandler(term, logging.Formatter(FILE_LOG_FORMAT))
        others.addFilter(lambda record: not record.name.startswith("rltrain"))
        root.addHandler(others)
        sys.stdout = _Router(run_log, term.out, show=None, fileno=term.out.fileno())
        sys.stderr = _Router(run_log, term.err, show=None, fileno=term.err.fileno())
    else:
        term = _detach_terminal()
        log_fd = run_log.stream.fileno()
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        sys.stdout = _Router(run_log, term.out, show=is_own_worker_line, fileno=1)
        sys.stderr = _Router(run_log, term.err, show=is_own_worker_line, fileno=2)
    handler.terminal = term
    log.info(
        "logs of Ray, vLLM, Megatron and other libraries: %s%s",
        run_log.path,
        " (shown here too)" if verbose else " (--verbose shows them here)",
    )
    return run_log.path


def configure_worker_logging() -> None:
    """Log records at INFO (rltrain's at TRACE) and Python warnings to this (Ray worker) process's
    stderr, once."""
    root = logging.getLogger()
    if any(handler.get_name() == _WORKER_HANDLER for handler in root.handlers):
        return
    log.setLevel(TRACE)
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_WORKER_HANDLER)
    handler.setFormatter(logging.Formatter(WORKER_LOG_FORMAT))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)


def _seconds(elapsed: float) -> str:
    return f"{elapsed:.1f} s" if elapsed < 120 else f"{int(elapsed // 60)} min {elapsed % 60:.0f} s"


@contextmanager
def stage(what: str) -> Iterator[None]:
    """``rltrain: <what> ...`` now, ``rltrain: <what> ... done in <t>`` (or ``failed after``) at the end."""
    log.info("%s ...", what)
    start = time.perf_counter()
    try:
        yield
    except BaseException as err:
        outcome = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
        log.error("%s ... %s after %s", what, outcome, _seconds(time.perf_counter() - start))
        raise
    log.info("%s ... done in %s", what, _seconds(time.perf_counter() - start))
