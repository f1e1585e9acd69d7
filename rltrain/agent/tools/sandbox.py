"""The ``python`` tool: runs the model's program in the sandbox and answers with what it printed.

A thin tool over :mod:`rltrain.sandbox`, which holds the isolation, the limits and the outcomes
(see there). Here the outcome becomes text for the model: the program's output cut to
``max_output_chars`` characters, then, when the run went wrong, an ``error: ...`` line
(``error_kind``: ``timeout``, ``memory``, ``forbidden``, ``output_limit`` or ``crash``). Every
outcome is text for the model, never an exception.
"""

from __future__ import annotations

import time
from typing import Any

from rltrain.sandbox import SandboxLimits, isolation, run_python

from .base import Tool, ToolResult, cut_output


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
        """The sandbox's limits (:class:`~rltrain.sandbox.SandboxLimits` documents each)."""
        self.limits = SandboxLimits(
            memory_mb=memory_mb,
            cpu_seconds=cpu_seconds,
            file_size_mb=file_size_mb,
            max_processes=max_processes,
            namespaces=namespaces,
        )

    async def execute(
        self, arguments: dict[str, Any], *, timeout_s: float, max_output_chars: int
    ) -> ToolResult:
        start = time.monotonic()
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult.failure("bad_arguments", "error: the argument code must be a string")
        result = await run_python(
            code, limits=self.limits, timeout_s=timeout_s, max_output_chars=max_output_chars
        )
        seconds = time.monotonic() - start
        text, _ = cut_output(result.output, max_output_chars)
        if result.error_kind is None:
            return ToolResult(text=text or "(no output)", ok=True, error_kind=None, seconds=seconds)
        if text and not text.endswith("\n"):
            text += "\n"
        return ToolResult.failure(result.error_kind, f"{text}error: {result.error}", seconds=seconds)

    async def isolation(self) -> list[str]:
        """The kernel barriers this machine gives the tool's sandbox (``[]``: the audit hook alone)."""
        return await isolation(self.limits)
