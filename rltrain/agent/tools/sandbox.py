"""The ``python`` tool: runs the model's program in a sandbox and answers with what it printed.

Each call gets a fresh scratch directory (removed afterwards) and a process tree of its own (see
:mod:`.sandbox_child`): a session started for the call and killed as a whole process group when the
call ends, however it ends (cancelled included), so nothing the code started outlives the call.
Limits: wall clock (``timeout_s`` of the call), CPU time (``cpu_seconds``, ``RLIMIT_CPU``), address
space (``memory_mb``, ``RLIMIT_AS``), size of a written file (``file_size_mb``, ``RLIMIT_FSIZE``),
and output: stdout and stderr together, read until ``max_output_chars`` characters, when the
program is stopped. The code gets a fresh environment (none of the trainer's variables) and an
empty stdin. The interpreter is the trainer's own (``sys.executable -I``): its installed packages
can be imported. Reading files is not restricted: the code may read what the trainer's user may.

Barriers: an audit hook installed before the code runs refuses network access, processes, writes
outside the scratch directory and the ways around those (``forbidden``), and, where the kernel
allows unprivileged namespaces, new user, network, mount and PID namespaces stop them at the kernel
too: no network interface, every mount but the scratch directory read-only, and every process of
the code killed with the namespace's first process. On the machine this was built on (Linux 6.18,
root, no seccomp filter) all four namespaces and a private ``/proc`` are granted; in a container
whose seccomp profile refuses ``unshare`` (Docker's default) the audit hook is the only barrier,
and then ``ctypes``/``cffi`` (so numpy) are refused too. :meth:`PythonSandboxTool.isolation` says
which barriers a machine gives.

Outcomes (``error_kind``): ``None`` (ran, exit code 0); ``timeout`` (wall clock, or CPU time at
``SIGXCPU``); ``memory`` (an uncaught ``MemoryError``); ``forbidden``; ``output_limit``; ``crash``
(a non-zero exit: the output, traceback included, then the exit code; or killed by a signal).
Every outcome is text for the model, never an exception.
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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .base import Tool, ToolResult, cut_output

CHILD_SCRIPT = Path(__file__).with_name("sandbox_child.py")
REAP_TIMEOUT_S = 10.0
"""Longest wait for the killed process tree to be reaped (a kernel that cannot is a broken machine)."""
MIN_MEMORY_MB = 64
"""Below this the interpreter cannot start under RLIMIT_AS (it maps about 30 MB before any code)."""


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


class PythonSandboxTool(Tool):
    """Runs a Python program in a sandboxed process."""

    name = "python"
    description = (
        "Run a Python program and return what it prints (stdout and stderr). No network, no other "
        "processes; files only in the current directory, which is empty and deleted afterwards."
    )
    parameters = {  # noqa: RUF012  (read-only: a tool config overrides it per instance, never mutates it)
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The program; print what you want to see."}},
        "required": ["code"],
    }

    def __init__(
        self,
        *,
        memory_mb: int = 512,
        cpu_seconds: int = 10,
        file_size_mb: int = 16,
        max_processes: int = 64,
        namespaces: bool = True,
    ) -> None:
        """``memory_mb``: address-space limit; ``cpu_seconds``: CPU-time limit (whole seconds);
        ``file_size_mb``: largest file the code may write; ``max_processes``: ``RLIMIT_NPROC``,
        set only inside the sandbox's own user namespace where it counts the sandbox's processes
        (and threads) alone; ``namespaces``: try the kernel barriers (else the audit hook alone)."""
        for option, value, least in (
            ("memory_mb", memory_mb, MIN_MEMORY_MB),
            ("cpu_seconds", cpu_seconds, 1),
            ("file_size_mb", file_size_mb, 1),
            ("max_processes", max_processes, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{option} must be an integer of at least {least}, got {value!r}")
        if not isinstance(namespaces, bool):
            raise ValueError(f"namespaces must be true or false, got {namespaces!r}")
        self.memory_mb, self.cpu_seconds, self.file_size_mb = memory_mb, cpu_seconds, file_size_mb
        self.max_processes, self.namespaces = max_processes, namespaces

    async def execute(
        self, arguments: dict[str, Any], *, timeout_s: float, max_output_chars: int
    ) -> ToolResult:
        start = time.monotonic()
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult.failure("bad_arguments", "error: the argument code must be a string")
        run = await self._run(code, timeout_s=timeout_s, max_output_chars=max_output_chars)
        return self._result(
            run, timeout_s=timeout_s, max_output_chars=max_output_chars, seconds=time.monotonic() - start
        )

    async def isolation(self) -> list[str]:
        """The kernel barriers this machine gives a sandbox (``[]``: the audit hook alone)."""
        run = await self._run("", timeout_s=30.0, max_output_chars=1000)
        lines = [
            rest for first, _, rest in (line.partition(" ") for line in run.status) if first == "isolation"
        ]
        return [barrier for line in lines for barrier in line.split(",") if barrier]

    async def _run(self, code: str, *, timeout_s: float, max_output_chars: int) -> _Run:
        """Run ``code`` in a fresh scratch directory; the directory is gone when this returns."""
        root = Path(tempfile.mkdtemp(prefix="rltrain-sandbox-")).resolve()
        try:
            scratch = root / "work"
            scratch.mkdir()
            code_path = root / "main.py"
            code_path.write_text(code, encoding="utf-8")
            return await self._run_tree(
                code_path, scratch, timeout_s=timeout_s, max_output_chars=max_output_chars
            )
        finally:
            _remove_tree(root)

    async def _run_tree(
        self, code_path: Path, scratch: Path, *, timeout_s: float, max_output_chars: int
    ) -> _Run:
        status_read, status_write = os.pipe()
        settings = {
            "scratch": str(scratch),
            "code_path": str(code_path),
            "status_fd": status_write,
            "namespaces": self.namespaces,
            "memory_bytes": self.memory_mb << 20,
            "cpu_seconds": self.cpu_seconds,
            "file_size_bytes": self.file_size_mb << 20,
            "max_processes": self.max_processes,
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

    def _result(self, run: _Run, *, timeout_s: float, max_output_chars: int, seconds: float) -> ToolResult:
        text, _ = cut_output("".join(run.output), max_output_chars)
        kind, error = self._outcome(run, timeout_s=timeout_s, max_output_chars=max_output_chars)
        if kind is None:
            return ToolResult(text=text or "(no output)", ok=True, error_kind=None, seconds=seconds)
        if text and not text.endswith("\n"):
            text += "\n"
        return ToolResult.failure(kind, f"{text}error: {error}", seconds=seconds)

    def _outcome(self, run: _Run, *, timeout_s: float, max_output_chars: int) -> tuple[str | None, str]:
        """The error kind and message of a run (``(None, "")`` when it went well)."""
        forbidden = run.reported("forbidden")
        if forbidden is not None:
            return "forbidden", f"forbidden: {forbidden}"
        if run.reported("memory") is not None:
            return "memory", f"out of memory (the limit is {self.memory_mb} MB)"
        if run.overflow:
            return "output_limit", f"the output passed {max_output_chars} characters; the program was stopped"
        if run.timed_out:
            return "timeout", f"timed out after {timeout_s:g} s"
        killed, exited = run.reported("signal"), run.reported("exit")
        if killed is not None:
            number, cpu = int(killed.split()[0]), float(killed.split()[1])
            if number == signal.SIGXCPU or (number == signal.SIGKILL and cpu >= self.cpu_seconds):
                return "timeout", f"timed out: the CPU time limit of {self.cpu_seconds} s was reached"
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
