"""Run untrusted Python in an isolated process tree under limits: what it printed, how it ended.

The one sandbox of the project: the agent's ``python`` tool (:mod:`rltrain.agent.tools.sandbox`)
and the ``code`` reward (:mod:`rltrain.rewards.code_exec`) both run programs through
:func:`run_python`. Stdlib only.

Each run gets a fresh scratch directory (removed afterwards) and a process tree of its own (see
:mod:`.child`): a session started for the run and killed as a whole process group when the run
ends, however it ends (cancelled included), so nothing the code started outlives the run.
Limits (:class:`SandboxLimits`): wall clock (``timeout_s`` of the run), CPU time (``cpu_seconds``,
``RLIMIT_CPU``), address space (``memory_mb``, ``RLIMIT_AS``), size of a written file
(``file_size_mb``, ``RLIMIT_FSIZE``), and output: stdout and stderr together, read until
``max_output_chars`` characters, when the program is stopped. The code gets a fresh environment
(none of the trainer's variables) and an empty stdin. The interpreter is the trainer's own
(``sys.executable -I``): its installed packages can be imported. Reading files is not restricted:
the code may read what the trainer's user may.

Barriers: an audit hook installed before the code runs refuses network access, processes, writes
outside the scratch directory and the ways around those (``forbidden``), and, where the kernel
allows unprivileged namespaces, new user, network, mount and PID namespaces stop them at the kernel
too: no network interface, every mount but the scratch directory read-only, and every process of
the code killed with the namespace's first process. On the machine this was built on (Linux 6.18,
root, no seccomp filter) all four namespaces and a private ``/proc`` are granted; in a container
whose seccomp profile refuses ``unshare`` (Docker's default) the audit hook is the only barrier,
and then ``ctypes``/``cffi`` (so numpy) are refused too. :func:`isolation` says which barriers a
machine gives.

Outcomes (:attr:`SandboxResult.error_kind`): ``None`` (ran, exit code 0); ``timeout`` (wall
clock, or CPU time at ``SIGXCPU``); ``memory`` (an uncaught ``MemoryError``); ``forbidden``;
``output_limit``; ``crash`` (a non-zero exit, or killed by a signal). Every outcome is a result,
never an exception.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

CHILD_SCRIPT = Path(__file__).with_name("child.py")
REAP_TIMEOUT_S = 10.0
"""Longest wait for the killed process tree to be reaped (a kernel that cannot is a broken machine)."""
MIN_MEMORY_MB = 64
"""Below this the interpreter cannot start under RLIMIT_AS (it maps about 30 MB before any code)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use; checked when made."""

    memory_mb: int = 512
    """Address-space limit (``RLIMIT_AS``), at least :data:`MIN_MEMORY_MB`."""
    cpu_seconds: int = 10
    """CPU-time limit in whole seconds (``RLIMIT_CPU``)."""
    file_size_mb: int = 16
    """Largest file the code may write (``RLIMIT_FSIZE``)."""
    max_processes: int = 64
    """``RLIMIT_NPROC``, set only inside the sandbox's own user namespace, where it counts the
    sandbox's processes (and threads) alone."""
    namespaces: bool = True
    """Try the kernel barriers (else the audit hook alone)."""

    def __post_init__(self) -> None:
        for option, value, least in (
            ("memory_mb", self.memory_mb, MIN_MEMORY_MB),
            ("cpu_seconds", self.cpu_seconds, 1),
            ("file_size_mb", self.file_size_mb, 1),
            ("max_processes", self.max_processes, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{option} must be an integer of at least {least}, got {value!r}")
        if not isinstance(self.namespaces, bool):
            raise ValueError(f"namespaces must be true or false, got {self.namespaces!r}")


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended."""

    output: str
    """stdout and stderr together, as printed; past ``max_output_chars`` (by up to one read) when
    the run was stopped for its output."""
    error_kind: str | None
    """``None`` (exit code 0), ``timeout``, ``memory``, ``forbidden``, ``output_limit`` or ``crash``."""
    error: str
    """What went wrong in words (``""`` when ``error_kind`` is None)."""


@dataclass
class _Run:
    """What one run of the process tree gave."""

    output: list[str] = field(default_factory=list)
    num_chars: int = 0
    overflow: bool = False
    timed_out: bool = False
    status: list[str] = field(default_factory=list)

    def reported(self, word: str) -> str | None:
        """What follows ``word`` on its last status line, or None when it was not reported."""
        lines = [rest for first, _, rest in (line.partition(" ") for line in self.status) if first == word]
        return lines[-1] if lines else None


async def run_python(
    code: str, *, limits: SandboxLimits, timeout_s: float, max_output_chars: int
) -> SandboxResult:
    """Run the program ``code`` in the sandbox under ``limits`` for at most ``timeout_s`` seconds."""
    run = await _run(code, limits=limits, timeout_s=timeout_s, max_output_chars=max_output_chars)
    kind, error = _outcome(run, limits=limits, timeout_s=timeout_s, max_output_chars=max_output_chars)
    return SandboxResult(output="".join(run.output), error_kind=kind, error=error)


async def isolation(limits: SandboxLimits) -> list[str]:
    """The kernel barriers this machine gives a sandbox (``[]``: the audit hook alone)."""
    run = await _run("", limits=limits, timeout_s=30.0, max_output_chars=1000)
    lines = [rest for first, _, rest in (line.partition(" ") for line in run.status) if first == "isolation"]
    return [barrier for line in lines for barrier in line.split(",") if barrier]


async def _run(code: str, *, limits: SandboxLimits, timeout_s: float, max_output_chars: int) -> _Run:
    """Run ``code`` in a fresh scratch directory; the directory is gone when this returns."""
    root = Path(tempfile.mkdtemp(prefix="rltrain-sandbox-")).resolve()
    try:
        scratch = root / "work"
        scratch.mkdir()
        code_path = root / "main.py"
        code_path.write_text(code, encoding="utf-8")
        return await _run_tree(
            code_path, scratch, limits=limits, timeout_s=timeout_s, max_output_chars=max_output_chars
        )
    finally:
        _remove_tree(root)


async def _run_tree(
    code_path: Path, scratch: Path, *, limits: SandboxLimits, timeout_s: float, max_output_chars: int
) -> _Run:
    status_read, status_write = os.pipe()
    settings = {
        "scratch": str(scratch),
        "code_path": str(code_path),
        "status_fd": status_write,
        "namespaces": limits.namespaces,
        "memory_bytes": limits.memory_mb << 20,
        "cpu_seconds": limits.cpu_seconds,
        "file_size_bytes": limits.file_size_mb << 20,
        "max_processes": limits.max_processes,
    }
    run = _Run()
    try:
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", "-u", str(CHILD_SCRIPT), json.dumps(settings),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                pass_fds=(status_write,),
                start_new_session=True,
                cwd=scratch,
                env=_environment(scratch),
            )  # fmt: skip
        finally:
            os.close(status_write)
        try:
            await asyncio.wait_for(_read_output(proc, run, max_output_chars), timeout_s)
        except TimeoutError:
            run.timed_out = True
        finally:
            _kill_group(proc.pid)
            await asyncio.wait_for(_finish(proc), REAP_TIMEOUT_S)
        run.status = _read_all(status_read).decode(errors="replace").splitlines()
    finally:
        os.close(status_read)
    return run


def _outcome(
    run: _Run, *, limits: SandboxLimits, timeout_s: float, max_output_chars: int
) -> tuple[str | None, str]:
    """The error kind and message of a run (``(None, "")`` when it went well)."""
    forbidden = run.reported("forbidden")
    if forbidden is not None:
        return "forbidden", f"forbidden: {forbidden}"
    if run.reported("memory") is not None:
        return "memory", f"out of memory (the limit is {limits.memory_mb} MB)"
    if run.overflow:
        return "output_limit", f"the output passed {max_output_chars} characters; the program was stopped"
    if run.timed_out:
        return "timeout", f"timed out after {timeout_s:g} s"
    killed, exited = run.reported("signal"), run.reported("exit")
    if killed is not None:
        number, cpu = int(killed.split()[0]), float(killed.split()[1])
        if number == signal.SIGXCPU or (number == signal.SIGKILL and cpu >= limits.cpu_seconds):
            return "timeout", f"timed out: the CPU time limit of {limits.cpu_seconds} s was reached"
        return "crash", f"the program was killed by {signal.Signals(number).name}"
    if exited is None:  # the tree ended before the waiter could report: a sandbox failure, shown as such
        return "crash", "the sandbox ended without reporting how the program ended"
    if int(exited.split()[0]) != 0:
        return "crash", f"the program exited with code {exited.split()[0]}"
    return None, ""


async def _read_output(proc: asyncio.subprocess.Process, run: _Run, max_chars: int) -> None:
    """Read stdout+stderr into ``run`` until EOF (then wait for the exit) or past ``max_chars``."""
    assert proc.stdout is not None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while chunk := await proc.stdout.read(1 << 16):
        text = decoder.decode(chunk)
        run.output.append(text)
        run.num_chars += len(text)
        if run.num_chars > max_chars:
            run.overflow = True
            return
    run.output.append(decoder.decode(b"", final=True))
    await proc.wait()


async def _finish(proc: asyncio.subprocess.Process) -> None:
    """Reap the killed process; its output left unread is read to EOF and dropped (asyncio's
    ``wait`` returns only once the pipe has closed)."""
    assert proc.stdout is not None
    while await proc.stdout.read(1 << 16):
        pass
    await proc.wait()


def _kill_group(pgid: int) -> None:
    """SIGKILL every process left in the call's process group (none is fine)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _read_all(fd: int) -> bytes:
    """What the status pipe holds; every writer is dead by now, so this reaches EOF without blocking."""
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):  # a writer that escaped the kill: take what is there
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    return b"".join(chunks)


def _environment(scratch: Path) -> dict[str, str]:
    """A fresh environment for the code (none of the trainer's variables, tokens included)."""
    return {
        "PATH": os.defpath,
        "HOME": str(scratch),
        "TMPDIR": str(scratch),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        # one malloc arena and one BLAS thread: each extra thread would reserve address space
        # counted against RLIMIT_AS
        "MALLOC_ARENA_MAX": "1",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
    }


def _remove_tree(root: Path) -> None:
    """Remove the call's directory, even where the code took the permissions off its own folders."""
    for folder, subfolders, _ in os.walk(root):
        for name in subfolders:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o700)
    shutil.rmtree(root)
