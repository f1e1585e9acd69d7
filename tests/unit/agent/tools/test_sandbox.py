"""The ``python`` tool over the sandbox: the run's outcome as text for the model (output cut to
``max_output_chars``, then an ``error:`` line), its limits taken from the tool config."""

from __future__ import annotations

import asyncio

import pytest

from rltrain.agent.tools import PythonSandboxTool
from rltrain.agent.tools.base import NOTE_CHARS
from rltrain.sandbox import SandboxLimits


def execute(code: object, *, max_output_chars: int = 200, **limits: int) -> tuple[str, bool, str | None]:
    tool = PythonSandboxTool(memory_mb=limits.pop("memory_mb", 256), **limits)
    result = asyncio.run(tool.execute({"code": code}, timeout_s=5.0, max_output_chars=max_output_chars))
    return result.text, result.ok, result.error_kind


def test_output_or_a_note_that_there_was_none() -> None:
    assert execute("print(6 * 7)") == ("42\n", True, None)
    assert execute("import os") == ("(no output)", True, None)


def test_a_failed_run_ends_with_its_error_line() -> None:
    assert execute("print('start', end='')\nimport sys; sys.exit(3)") == (
        "start\nerror: the program exited with code 3",
        False,
        "crash",
    )
    assert execute("x = bytearray(10**10)", memory_mb=128) == (
        "error: out of memory (the limit is 128 MB)",
        False,
        "memory",
    )
    assert execute(["print(1)"]) == ("error: the argument code must be a string", False, "bad_arguments")


def test_a_flood_is_cut_with_a_note_before_the_error_line() -> None:
    text, ok, kind = execute("print('x' * 10_000_000)", max_output_chars=300)
    assert (text, ok, kind) == (
        "x" * 300
        + "\n[output cut at 300 characters]\nerror: the output passed 300 characters; the program was stopped",
        False,
        "output_limit",
    )
    assert len(text) <= 300 + NOTE_CHARS


def test_the_config_sets_the_limits_and_bad_ones_fail_when_made() -> None:
    tool = PythonSandboxTool(memory_mb=300, cpu_seconds=3, file_size_mb=2, max_processes=8, namespaces=False)
    assert tool.limits == SandboxLimits(
        memory_mb=300, cpu_seconds=3, file_size_mb=2, max_processes=8, namespaces=False
    )
    with pytest.raises(ValueError, match=r"^cpu_seconds must be an integer of at least 1, got 0$"):
        PythonSandboxTool(cpu_seconds=0)
