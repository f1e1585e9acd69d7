"""Code reward: run the response's program against the row's stdin/stdout tests in the sandbox.

Data sources: ``code`` and verl's code datasets ``codecontests``, ``apps``, ``codeforces``, ``taco``.

Ground truth: the JSON object ``{"inputs": [str, ...], "outputs": [str, ...]}`` (verl's and APPS's
stdin/stdout format): test ``i`` feeds ``inputs[i]`` to the program's standard input and expects
``outputs[i]`` on its standard output. Outputs are compared line by line with surrounding
whitespace stripped from each line and from the whole text. Call-based tests (``fn_name``) are
not run: the load check refuses them, as it refuses a ground truth that is not such an object.

The program is the last fenced ```` ```python ```` (or ``py``/``python3``) block of the response,
else the whole response. It runs once in the sandbox (:func:`rltrain.sandbox.run_python`:
no network, no other processes, writes only in a scratch directory, ``memory_mb`` of address
space, ``timeout_s`` of wall clock for all tests together and as many CPU seconds, rounded up)
under a small harness that runs it afresh for each test, with file descriptors 0 and 1 on the
test's input and a capture file, and stops at the first failing test. A test fails on wrong
output, an exception, or a non-zero ``sys.exit``. The harness reports on the sandbox's output
with a random token made for the call; the report is not proof against a program written to
find that token in its harness and print it.

Score: ``correct_score`` when every test passes; else ``format_score`` when the response had a
fenced block, else 0. ``answer`` is the fenced program (None without one); ``extra`` holds
``tests_passed`` (the fraction of tests passed before the first failure; 0 when the sandbox
stopped the run) and then ``sandbox_error`` (its error kind: ``timeout``, ``memory``,
``forbidden``, ``output_limit``, ``crash``). A program's ``MemoryError`` ends the run (the
sandbox reports it); its other exceptions fail the test at hand.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rltrain.rewards.registry import RewardResult, register_reward
from rltrain.sandbox import SandboxLimits, run_python

CODE_DATA_SOURCES = ("code", "codecontests", "apps", "codeforces", "taco")
"""Data sources scored by :func:`code_reward`."""

MAX_OUTPUT_CHARS = 64_000
"""What the sandboxed run may print beside its captured test outputs (its stderr, mostly)."""

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

_HARNESS = r"""
import os
import sys

CODE = {code!r}
CASES = {cases!r}
TOKEN = {token!r}


def lines(text):
    return [line.strip() for line in text.strip().splitlines()]


def redirect(fd, path, flags):
    opened = os.open(path, flags, 0o600)
    if opened != fd:  # fd itself was free (the program closed it): the file is on it already
        os.dup2(opened, fd)
        os.close(opened)


def run_case(program, case_input):
    with open("stdin.txt", "w", encoding="utf-8") as f:
        f.write(case_input)
    redirect(0, "stdin.txt", os.O_RDONLY)
    redirect(1, "stdout.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    ended_well = True
    try:
        exec(program, {{"__name__": "__main__", "__builtins__": __builtins__}})
    except SystemExit as stop:
        ended_well = stop.code in (None, 0)
    except MemoryError:  # the sandbox reports it as such
        raise
    except Exception:
        ended_well = False
    finally:
        sys.stdout.flush()
    with open("stdout.txt", encoding="utf-8", errors="replace") as f:
        return ended_well, f.read()


report = os.dup(1)
passed = 0
try:
    program = compile(CODE, "<solution>", "exec")
except (SyntaxError, ValueError):
    program = None
if program is not None:
    for case_input, expected in CASES:
        ended_well, output = run_case(program, case_input)
        if not (ended_well and lines(output) == lines(expected)):
            break
        passed += 1
os.write(report, ("\n%s %d %d\n" % (TOKEN, passed, len(CASES))).encode())
"""


def extract_program(response: str) -> str | None:
    """The last fenced Python block of ``response`` (``python``, ``python3`` or ``py``), or None."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else None


def parse_tests(ground_truth: str) -> list[tuple[str, str]]:
    """``(stdin, expected stdout)`` per test of a code ground truth; ValueError saying what is wrong."""
    try:
        tests = json.loads(ground_truth)
    except json.JSONDecodeError:
        raise ValueError('is not JSON (a code ground truth is {"inputs": [...], "outputs": [...]})') from None
    if not isinstance(tests, dict) or "inputs" not in tests or "outputs" not in tests:
        raise ValueError('is not a JSON object with "inputs" and "outputs" (stdin/stdout tests)')
    if "fn_name" in tests:
        raise ValueError("has call-based tests (fn_name); the code reward runs stdin/stdout tests only")
    inputs, outputs = tests["inputs"], tests["outputs"]
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise ValueError('needs "inputs" and "outputs" as lists of the same length')
    if not inputs:
        raise ValueError("has no tests")
    if not all(isinstance(x, str) for x in (*inputs, *outputs)):
        raise ValueError('needs strings in "inputs" and "outputs" (stdin and stdout texts)')
    return list(zip(inputs, outputs))


def code_tests_problem(ground_truth: str) -> str | None:
    """Why ``ground_truth`` cannot be the tests of a code row, or None."""
    try:
        parse_tests(ground_truth)
    except ValueError as err:
        return str(err)
    return None


def run_tests(
    program: str, tests: list[tuple[str, str]], *, timeout_s: float, memory_mb: int
) -> tuple[int, str | None]:
    """How many leading tests ``program`` passes in the sandbox (it stops at the first failure), and
    the sandbox's error kind when it stopped the run (``timeout``, ``memory``, ``forbidden``,
    ``output_limit``, ``crash``), else None."""
    token = secrets.token_hex(16)
    harness = _HARNESS.format(code=program, cases=tests, token=token)
    limits = SandboxLimits(memory_mb=memory_mb, cpu_seconds=max(1, math.ceil(timeout_s)))
    result = _run(run_python(harness, limits=limits, timeout_s=timeout_s, max_output_chars=MAX_OUTPUT_CHARS))
    if result.error_kind is not None:
        return 0, result.error_kind
    last = result.output.rstrip("\n").rsplit("\n", 1)[-1].split()
    if len(last) != 3 or last[0] != token:  # the harness did not get to its report
        return 0, "crash"
    return int(last[1]), None


def _run(coroutine: Any) -> Any:
    """Run ``coroutine`` to its end from synchronous code, also where this thread runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


@register_reward(*CODE_DATA_SOURCES, ground_truth=code_tests_problem)
def code_reward(
    response: str,
    ground_truth: str,
    *,
    correct_score: float = 1.0,
    format_score: float = 0.0,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
) -> RewardResult:
    """``correct_score`` if the program passes every test, else ``format_score`` for a fenced
    program, else 0; ``timeout_s``, ``memory_mb``: the sandbox's limits (``reward.sandbox``)."""
    try:
        tests = parse_tests(ground_truth)
    except ValueError as err:
        raise ValueError(f"code ground truth {ground_truth[:80]!r} {err}") from None
    fenced = extract_program(response)
    program = fenced if fenced is not None else response
    passed, error = run_tests(program, tests, timeout_s=timeout_s, memory_mb=memory_mb)
    correct = passed == len(tests)
    score = correct_score if correct else (format_score if fenced is not None else 0.0)
    extra: dict[str, Any] = {"tests_passed": passed / len(tests)}
    if error is not None:
        extra["sandbox_error"] = error
    return RewardResult(score=score, correct=correct, answer=fenced, extra=extra)
