"""The processes of one sandboxed Python run (run as a script by :mod:`.runner`; stdlib only).

``python -I -S -u child.py SETTINGS`` starts the *outer* process, a session leader. It
tries to move into new user, network, mount and PID namespaces (``unshare``), where the network
has no interface but a loopback that is down, every mount is read-only except the scratch
directory, and the first child is PID 1: when it ends the kernel kills every process left in the
namespace. Its child, the *waiter* (PID 1 there, with a /proc of its own; the outer itself when
the kernel refused the namespaces), forks the *user* process, which sets the resource limits,
enters the scratch directory and execs a fresh ``python -I -u child.py --run SETTINGS``.
That one installs an audit hook and runs the code from ``code_path``. Every process below the
outer asks the kernel to kill it when its parent dies.

Reports, one line each on the status pipe (``status_fd``):
- ``isolation user,net,pid,mount`` / ``isolation proc``: the kernel barriers in place (outer, waiter);
- ``forbidden WHAT``: the audit hook refused an action, and the code was stopped at once (user);
- ``memory``: the code ended with an uncaught ``MemoryError`` (user);
- ``exit CODE CPU`` / ``signal NUMBER CPU``: how the user process ended, its CPU seconds (waiter).

The audit hook refuses network access, starting or signalling processes (``_posixsubprocess``
included: it forks without an audit event), raising resource limits, writes outside the scratch
directory (``open`` for writing, remove, rename, link, chmod, ...) and opening a directory outside
it (a directory's file descriptor would lead around the path checks). It is how refusals become a
clear ``forbidden`` report, not a security boundary: CPython's audit hooks can be evaded by code
that sets out to (by racing a symlink, or calling C functions), which the namespaces stop. So C
functions (``ctypes``, ``cffi``; numpy imports ctypes) are allowed only where the network, mount
and PID namespaces all stand; without them, importing those is forbidden too.
"""

from __future__ import annotations

import builtins
import json
import linecache
import os
import resource
import signal
import sys
import traceback
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
MOUNT_ATTR_RDONLY = 1
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # the same number on every Linux architecture (added in 5.12)
PR_SET_PDEATHSIG = 1

_NETWORK_EVENTS = frozenset(
    {
        "socket.bind",
        "socket.connect",
        "socket.getaddrinfo",
        "socket.gethostbyaddr",
        "socket.gethostbyname",
        "socket.getnameinfo",
        "socket.sendmsg",
        "socket.sendto",
        "socket.sethostname",
    }
)
_PROCESS_EVENTS = frozenset(
    {"os.exec", "os.fork", "os.forkpty", "os.kill", "os.killpg", "os.posix_spawn", "os.spawn", "os.system",
     "signal.pthread_kill", "subprocess.Popen"}
)  # fmt: skip
_LIMIT_EVENTS = frozenset({"resource.prlimit", "resource.setrlimit"})
_C_MODULES = frozenset({"_cffi_backend", "_ctypes", "cffi", "ctypes"})
_PATH_EVENTS: dict[str, tuple[int, ...]] = {
    # event -> positions of the paths it changes (os.link's source too: a hard link to a file
    # outside would let the code write that file through the scratch directory)
    "os.chflags": (0,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.link": (0, 1),
    "os.mkdir": (0,),
    "os.remove": (0,),
    "os.removexattr": (0,),
    "os.rename": (0, 1),
    "os.rmdir": (0,),
    "os.setxattr": (0,),
    "os.symlink": (1,),
    "os.truncate": (0,),
    "os.utime": (0,),
    "shutil.rmtree": (0,),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_ALWAYS_WRITABLE = frozenset({"/dev/null"})


def report(status_fd: int, line: str) -> None:
    os.write(status_fd, (line + "\n").encode())


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def enter_namespaces(scratch: str) -> list[str]:
    """Move into new user, network, mount and PID namespaces with every mount read-only but
    ``scratch``; the barriers in place (``[]`` when the kernel refuses unsharing)."""
    import ctypes

    libc = _libc()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID) != 0:
        return []
    barriers = ["user", "net", "pid"]

    class MountAttr(ctypes.Structure):
        _fields_ = [(name, ctypes.c_uint64) for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]

    def set_attr(path: str, *, flags: int, attr: MountAttr) -> bool:
        size = ctypes.sizeof(attr)
        return libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, ctypes.byref(attr), size) == 0

    path = scratch.encode()
    if (
        libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0  # nothing propagates to the host
        and libc.mount(path, path, None, MS_BIND, None) == 0
        and set_attr("/", flags=AT_RECURSIVE, attr=MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0))
    ):
        if set_attr(scratch, flags=0, attr=MountAttr(0, MOUNT_ATTR_RDONLY, 0, 0)):
            barriers.append("mount")
        else:  # a read-only scratch directory would break the code's own files: undo
            set_attr("/", flags=AT_RECURSIVE, attr=MountAttr(0, MOUNT_ATTR_RDONLY, 0, 0))
    return barriers


def mount_proc() -> bool:
    """Mount a /proc of the new PID namespace (so the code sees only its own processes)."""
    return _libc().mount(b"proc", b"/proc", b"proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None) == 0


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when its parent dies (and exit if it already has).

    ``parent`` is the parent's pid as this process sees it: 0 for the first process of a new PID
    namespace, whose parent is outside it (a parent already dead goes unnoticed there; it died
    by the call's group kill, which kills this process too)."""
    _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def spawn_user(settings: dict[str, Any], *, own_user_namespace: bool) -> int:
    """Fork the user process: limits, scratch directory, then exec the interpreter that runs the code."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    die_with_parent(parent)
    limits = [
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_CPU, settings["cpu_seconds"]),
        (resource.RLIMIT_AS, settings["memory_bytes"]),
        (resource.RLIMIT_FSIZE, settings["file_size_bytes"]),
    ]
    if own_user_namespace:  # counted per user namespace there, so it bounds this sandbox alone
        limits.append((resource.RLIMIT_NPROC, settings["max_processes"]))
    for which, value in limits:
        # the hard CPU limit one second later is a SIGKILL for code that ignores SIGXCPU
        resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))
    os.chdir(settings["scratch"])
    os.set_inheritable(settings["status_fd"], True)
    os.execv(
        sys.executable, [sys.executable, "-I", "-u", os.path.abspath(__file__), "--run", json.dumps(settings)]
    )
    raise AssertionError("unreachable: execv returned")


def wait_and_report(pid: int, status_fd: int) -> int:
    """Reap children until ``pid`` ends (PID 1 inherits orphans), report how it ended, its exit code."""
    while True:
        ended, status, usage = os.wait4(-1, 0)
        if ended == pid:
            break
    cpu = usage.ru_utime + usage.ru_stime
    if os.WIFSIGNALED(status):
        report(status_fd, f"signal {os.WTERMSIG(status)} {cpu:.3f}")
        return 128 + os.WTERMSIG(status)
    report(status_fd, f"exit {os.WEXITSTATUS(status)} {cpu:.3f}")
    return os.WEXITSTATUS(status)


def outer_main(settings: dict[str, Any]) -> int:
    status_fd = settings["status_fd"]
    barriers = enter_namespaces(settings["scratch"]) if settings["namespaces"] else []
    report(status_fd, "isolation " + ",".join(barriers))
    settings = {**settings, "barriers": barriers}
    if "pid" not in barriers:
        return wait_and_report(spawn_user(settings, own_user_namespace=False), status_fd)
    waiter = os.fork()
    if waiter == 0:  # PID 1 of the new namespace
        die_with_parent(0)
        if mount_proc():
            report(status_fd, "isolation proc")
        os._exit(wait_and_report(spawn_user(settings, own_user_namespace=True), status_fd))
    _, status = os.waitpid(waiter, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def install_audit_hook(scratch: str, status_fd: int, *, allow_c: bool) -> None:
    """Refuse what the sandbox forbids: report ``forbidden WHAT`` and end the process at once.

    ``allow_c``: let the code load C functions (``ctypes``, ``cffi``; numpy imports ctypes), which
    lead around the hook, so only where the kernel barriers stand behind it."""
    realpath, join, getcwd, isdir, readlink = (
        os.path.realpath,
        os.path.join,
        os.getcwd,
        os.path.isdir,
        os.readlink,
    )
    inside_prefix = scratch.rstrip("/") + "/"

    def resolve(path: Any) -> str:
        if isinstance(path, int):  # a file descriptor: where it points
            return readlink(f"/proc/self/fd/{path}")
        return realpath(join(getcwd(), os.fsdecode(path)))

    def inside(path: Any) -> bool:
        try:
            full = resolve(path)
        except (OSError, TypeError, ValueError):
            return False
        return full == scratch or full.startswith(inside_prefix) or full in _ALWAYS_WRITABLE

    def deny(what: str) -> None:
        try:
            report(status_fd, f"forbidden {what}")
        finally:
            os._exit(1)

    def shown(path: Any) -> str:
        text = repr(path)
        return text if len(text) <= 80 else text[:77] + "..."

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):  # wraps a descriptor already open (stdout, or one checked when opened)
                return
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(
                (flags or 0) & _WRITE_FLAGS
            )
            if path is None or inside(path):
                return
            if writes:
                deny(f"writing {shown(path)} outside the working directory")
            if isdir(path):
                deny(f"opening the directory {shown(path)} outside the working directory")
        elif event in _PATH_EVENTS:
            for i in _PATH_EVENTS[event]:
                if i < len(args) and args[i] is not None and not inside(args[i]):
                    deny(f"changing {shown(args[i])} outside the working directory ({event})")
        elif event in _NETWORK_EVENTS:
            deny(f"network access ({event})")
        elif event in _PROCESS_EVENTS:
            deny(f"starting or signalling a process ({event})")
        elif event in _LIMIT_EVENTS:
            deny(f"changing resource limits ({event})")
        elif event == "import" and args[0].partition(".")[0] == "_posixsubprocess":
            deny(f"starting a process (importing {args[0]}, which subprocess needs)")
        elif allow_c:
            return
        elif event.startswith("ctypes."):
            deny(f"calling C functions ({event})")
        elif event == "import" and args[0].partition(".")[0] in _C_MODULES:
            deny(f"loading C functions (importing {args[0]}) without the kernel's barriers")

    sys.addaudithook(hook)


def run_code(code: str, status_fd: int) -> int:
    """Run the code as ``__main__``; its exit code (1 with a traceback for an uncaught exception)."""
    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
    out_of_memory = b"memory\n"  # encoded now: there may be no memory to encode it later
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(code, "<code>", "exec"), namespace)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except MemoryError:
        namespace.clear()
        os.write(status_fd, out_of_memory)
        return 1
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        return 1
    return 0


def user_main(settings: dict[str, Any]) -> int:
    with open(settings["code_path"], encoding="utf-8") as f:
        code = f.read()
    sys.argv = ["<code>"]
    kernel_barriers = {"net", "mount", "pid"}.issubset(settings["barriers"])
    install_audit_hook(settings["scratch"], settings["status_fd"], allow_c=kernel_barriers)
    return run_code(code, settings["status_fd"])


if __name__ == "__main__":
    if sys.argv[1] == "--run":
        os._exit(user_main(json.loads(sys.argv[2])))
    os._exit(outer_main(json.loads(sys.argv[1])))
