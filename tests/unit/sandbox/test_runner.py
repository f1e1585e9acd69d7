"""The sandbox runner with real processes: each escape attempt is contained, reported and quick.

Most cases run twice: with the kernel's namespaces (where this machine grants them) and with the
audit hook alone (``namespaces=False``, what a container that refuses ``unshare`` gets). After every
call no process of the sandbox is left (found by its command line in /proc) and its directory is
gone.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rltrain.sandbox import SandboxLimits, SandboxResult, isolation, run_python
from rltrain.sandbox.runner import CHILD_SCRIPT


def sandbox_processes(marker: bytes = str(CHILD_SCRIPT).encode()) -> list[int]:
    """Pids of live processes whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker in cmdline:
                found.append(int(entry))
    return found


@pytest.fixture(params=[True, False], ids=["namespaces", "audit-hook"])
def namespaces(request: pytest.FixtureRequest) -> Iterator[bool]:
    assert sandbox_processes() == []
    yield request.param
    assert sandbox_processes() == [], "a process of the sandbox outlived its call"


def execute(
    code: str, *, namespaces: bool = True, timeout_s: float = 2.0, max_output_chars: int = 200, **limits: int
) -> SandboxResult:
    chosen = SandboxLimits(memory_mb=limits.pop("memory_mb", 256), namespaces=namespaces, **limits)
    return asyncio.run(
        run_python(code, limits=chosen, timeout_s=timeout_s, max_output_chars=max_output_chars)
    )


def outcome(result: SandboxResult) -> tuple[str, str | None, str]:
    return result.output, result.error_kind, result.error


def test_prints_the_result_and_works_in_a_scratch_directory_removed_afterwards(namespaces: bool) -> None:
    code = "import os\nprint(6 * 7)\nopen('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read(), os.getcwd())"
    result = execute(code, namespaces=namespaces)
    _, cwd = result.output.split("\n")[1].split()
    assert outcome(result) == (f"42\nkept {cwd}\n", None, "")
    assert Path(cwd).name == "work" and not Path(cwd).parent.exists()


def test_no_output_and_the_environment_is_not_passed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLTRAIN_TEST_SECRET", "hunter2")
    assert outcome(execute("import os")) == ("", None, "")
    assert outcome(execute("import os; print(os.environ.get('RLTRAIN_TEST_SECRET'))")) == ("None\n", None, "")


def test_crash_shows_the_traceback_and_the_exit_code(namespaces: bool) -> None:
    result = execute("print('start')\nraise ValueError('bad value')", namespaces=namespaces)
    assert outcome(result) == (
        'start\nTraceback (most recent call last):\n  File "<code>", line 2, in <module>\n'
        "    raise ValueError('bad value')\nValueError: bad value\n",
        "crash",
        "the program exited with code 1",
    )
    assert outcome(execute("import sys; sys.exit(3)")) == ("", "crash", "the program exited with code 3")
    assert outcome(execute("1 +")) == (
        '  File "<code>", line 1\n    1 +\n       ^\nSyntaxError: invalid syntax\n',
        "crash",
        "the program exited with code 1",
    )


def test_infinite_loop_is_stopped_at_the_wall_clock_limit(namespaces: bool) -> None:
    start = time.monotonic()
    result = execute("print('looping')\nwhile True:\n    pass", namespaces=namespaces, timeout_s=2.0)
    elapsed = time.monotonic() - start
    assert outcome(result) == ("looping\n", "timeout", "timed out after 2 s")
    assert 2.0 <= elapsed < 3.0


def test_cpu_time_limit() -> None:
    start = time.monotonic()
    result = execute("while True:\n    pass", cpu_seconds=1, timeout_s=20.0)
    assert outcome(result) == ("", "timeout", "timed out: the CPU time limit of 1 s was reached")
    assert time.monotonic() - start < 10.0  # 1 s of CPU plus startup, on a busy machine


@pytest.mark.parametrize(
    "code",
    ["blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))", "x = bytearray(10**10)"],
    ids=["grow", "one"],
)
def test_memory_bomb(namespaces: bool, code: str) -> None:
    start = time.monotonic()
    result = execute(code, namespaces=namespaces, memory_mb=256)
    assert outcome(result) == ("", "memory", "out of memory (the limit is 256 MB)")
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize(
    ("code", "event"),
    [
        ("import os\nwhile True:\n    os.fork()", "os.fork"),
        ("import subprocess", "importing _posixsubprocess, which subprocess needs"),
        ("import os\nos.system('sleep 100')", "os.system"),
        ("import os\nos.posix_spawn('/usr/bin/sleep', ['sleep', '100'], {})", "os.posix_spawn"),
        ("import os\nos.kill(os.getppid(), 9)", "os.kill"),
    ],
    ids=["fork-bomb", "subprocess", "system", "spawn", "kill"],
)
def test_processes_are_forbidden(namespaces: bool, code: str, event: str) -> None:
    result = execute(code, namespaces=namespaces)
    assert (result.output, result.error_kind) == ("", "forbidden")
    assert result.error in (
        f"forbidden: starting or signalling a process ({event})",
        f"forbidden: starting a process ({event})",
    )


def test_a_process_forked_around_the_audit_hook_dies_with_the_call() -> None:
    """Where the kernel barriers stand, ctypes is allowed: a fork through libc, in a new session,
    sleeping, is still killed with the namespace when the call ends."""
    code = (
        "import ctypes, time\nlibc = ctypes.CDLL(None)\npid = libc.fork()\n"
        "if pid == 0:\n    libc.setsid()\n    time.sleep(100)\nprint('forked', pid > 0)"
    )
    assert sandbox_processes() == []
    if not {"net", "mount", "pid"}.issubset(asyncio.run(isolation(SandboxLimits(memory_mb=256)))):
        assert outcome(execute(code))[1] == "forbidden"  # no kernel barrier: ctypes is refused
        return
    assert outcome(execute(code)) == ("forked True\n", None, "")
    assert sandbox_processes() == []


@pytest.mark.parametrize(
    "attempt",
    [
        "socket.create_connection(('127.0.0.1', PORT), timeout=1)",
        "socket.socket().connect(('127.0.0.1', PORT))",
    ],
    ids=["create_connection", "connect"],
)
def test_network_connection_is_forbidden_and_never_arrives(namespaces: bool, attempt: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        result = execute(f"import socket\n{attempt.replace('PORT', str(port))}", namespaces=namespaces)
        readable, _, _ = select.select([listener], [], [], 0.2)
    event = "socket.getaddrinfo" if "create_connection" in attempt else "socket.connect"
    assert outcome(result) == ("", "forbidden", f"forbidden: network access ({event})")
    assert readable == [], "the listener saw a connection"


@pytest.mark.parametrize(
    ("code", "what"),
    [
        ("open(OUT, 'w').write('x')", "writing OUT outside the working directory"),
        ("import os\nos.open(OUT, os.O_WRONLY | os.O_CREAT)", "writing OUT outside the working directory"),
        ("open('../main.py', 'a')", "writing '../main.py' outside the working directory"),
        ("import os\nos.symlink(OUT, 'link')\nopen('link', 'w')", "writing 'link' outside the working directory"),
        ("open('mine', 'w').close()\nimport os\nos.rename('mine', OUT)", "changing OUT outside the working directory (os.rename)"),
        ("import shutil\nshutil.copy(__import__('sys').executable, OUT)", "writing OUT outside the working directory"),
    ],
    ids=["open", "os.open", "parent", "symlink", "rename", "copy"],
)  # fmt: skip
def test_writes_outside_the_scratch_directory_are_forbidden(
    namespaces: bool, tmp_path: Path, code: str, what: str
) -> None:
    out = tmp_path / "outside.txt"
    result = execute(code.replace("OUT", repr(str(out))), namespaces=namespaces)
    assert outcome(result) == ("", "forbidden", f"forbidden: {what.replace('OUT', repr(str(out)))}")
    assert not out.exists()


def test_flood_of_output_is_cut_and_stopped_quickly(namespaces: bool) -> None:
    start = time.monotonic()
    result = execute("print('x' * 10_000_000)\nprint('never')", namespaces=namespaces, max_output_chars=300)
    assert time.monotonic() - start < 1.5
    assert (result.error_kind, result.error) == (
        "output_limit",
        "the output passed 300 characters; the program was stopped",
    )
    # the reader stops at its first read past the limit: at most one pipe read (64 KiB) beyond 300
    assert 300 < len(result.output) <= 300 + (1 << 16) and result.output == "x" * len(result.output)


def test_cancelled_call_leaves_nothing_behind() -> None:
    async def cancel_soon() -> None:
        task = asyncio.create_task(
            run_python(
                "import time; time.sleep(100)",
                limits=SandboxLimits(memory_mb=256),
                timeout_s=60.0,
                max_output_chars=100,
            )
        )
        await asyncio.sleep(0.5)
        assert len(sandbox_processes()) >= 2  # the outer process and the code's (and PID 1 between them)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_soon())
    assert sandbox_processes() == []
    assert list(Path(tempfile.gettempdir()).glob("rltrain-sandbox-*")) == []


def test_without_namespaces_no_kernel_barrier_is_claimed() -> None:
    assert asyncio.run(isolation(SandboxLimits(namespaces=False))) == []


def test_kernel_barriers_on_their_own(tmp_path: Path) -> None:
    """enter_namespaces alone, no audit hook: the network is unreachable, the file system read-only
    but for the scratch directory, and a process left in the namespace dies with its PID 1."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = tmp_path / "outside.txt"
    script = f"""
import errno, os, socket, sys, time
from rltrain.sandbox.child import enter_namespaces
barriers = enter_namespaces({str(scratch)!r})
print(",".join(barriers), flush=True)
if barriers:
    pid = os.fork()
    if pid == 0:  # PID 1 of the namespace
        if os.fork() == 0:
            os.execv("/usr/bin/sleep", ["sleep", "987.654"])
        for attempt in (lambda: socket.create_connection(("127.0.0.1", PORT), timeout=1), lambda: open({str(out)!r}, "w")):
            try:
                attempt()
                print("allowed", flush=True)
            except OSError as e:
                print(errno.errorcode[e.errno], flush=True)
        open({str(scratch / "mine")!r}, "w").write("ok")
        time.sleep(0.3)  # the sleeper has exec'd
        os._exit(0)
    os.waitpid(pid, 0)
"""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-c", script.replace("PORT", str(port))],
            capture_output=True,
            text=True,
            timeout=30,
        )
        readable, _, _ = select.select([listener], [], [], 0.2)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.split()
    if not lines:
        pytest.skip("this kernel refuses unprivileged namespaces: the audit hook is the only barrier here")
    assert lines == ["user,net,pid,mount", "ENETUNREACH", "EROFS"]
    assert readable == [] and not out.exists() and (scratch / "mine").read_text() == "ok"
    time.sleep(0.2)
    assert sandbox_processes(b"987.654") == [], "a process outlived its PID namespace"


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"memory_mb": 63}, "memory_mb must be an integer of at least 64, got 63"),
        ({"cpu_seconds": 1.5}, "cpu_seconds must be an integer of at least 1, got 1.5"),
        ({"max_processes": True}, "max_processes must be an integer of at least 1, got True"),
        ({"namespaces": 1}, "namespaces must be true or false, got 1"),
    ],
)
def test_limits_are_checked_when_made(limits: dict, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        SandboxLimits(**limits)
    assert str(caught.value) == message
