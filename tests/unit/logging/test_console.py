"""The console set-up of a run: rltrain's lines on the terminal, everything else in the run's log.

Each case runs a small script in a subprocess (the set-up rewires file descriptors 1 and 2 and
``sys.stdout``/``sys.stderr`` of its process) that writes one line through every path a library
uses: log records, Python warnings, ``print``, C-level writes, lines Ray forwards from a worker.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rltrain.logging.console import is_own_worker_line

SCRIPT = textwrap.dedent(
    """
    import logging, os, sys, warnings
    from rltrain.logging.console import capture_run_output, log_path, stage, start_console, terminal

    start_console()
    logging.getLogger("rltrain.demo").info("before the log file")
    capture_run_output(log_path(sys.argv[1]), verbose=sys.argv[2] == "verbose")
    with stage("waiting"):
        pass
    logging.getLogger("vllm.engine").info("third-party info")
    logging.getLogger("megatron.core").warning("third-party warning")
    warnings.warn("a python warning", UserWarning)
    print("a print to stdout")
    print("a print to stderr", file=sys.stderr)
    os.write(1, b"C-level stdout\\n")
    os.write(2, b"C-level stderr\\n")
    for line in (
        "(actor_rollout_ref rank 0 pid=12) WARNING rltrain.workers.model_workers: worker warning",
        "(actor_rollout_ref rank 0 pid=12) INFO rltrain.workers.model_workers: worker info",
        "(actor_rollout_ref rank 0 pid=12) WARNING megatron.core: worker third-party warning",
    ):
        print(line, file=sys.stderr)
    print("step 1/2 | reward 0.500", file=terminal().out)
    logging.getLogger("rltrain.demo").warning("own warning")
    if sys.argv[3] == "fail":
        raise ValueError("boom")
    """
)

OWN_STDERR = [
    "rltrain: before the log file",
    "rltrain: logs of Ray, vLLM, Megatron and other libraries: {log} (--verbose shows them here)",
    "rltrain: waiting ...",
    "rltrain: waiting ... done in 0.0 s",
    "(actor_rollout_ref rank 0 pid=12) WARNING rltrain.workers.model_workers: worker warning",
    "rltrain: WARNING: own warning",
]
THIRD_PARTY = [
    "INFO vllm.engine: third-party info",
    "WARNING megatron.core: third-party warning",
    "UserWarning: a python warning",
    "a print to stdout",
    "a print to stderr",
    "(actor_rollout_ref rank 0 pid=12) INFO rltrain.workers.model_workers: worker info",
    "(actor_rollout_ref rank 0 pid=12) WARNING megatron.core: worker third-party warning",
]
C_LEVEL = ["C-level stdout", "C-level stderr"]


def run(tmp_path: Path, mode: str, *, end: str = "ok", merged: bool = False):
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), mode, end],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merged else subprocess.PIPE,
        text=True,
        timeout=120,
    )


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_terminal_shows_only_rltrain_lines_and_the_log_has_the_rest(tmp_path):
    result = run(tmp_path, "quiet")
    assert result.returncode == 0, result.stderr
    log = (tmp_path / "rltrain.log").read_text()
    assert lines(result.stderr) == [line.format(log=tmp_path / "rltrain.log") for line in OWN_STDERR]
    assert lines(result.stdout) == ["step 1/2 | reward 0.500"]
    for text in [*THIRD_PARTY, *C_LEVEL]:
        assert text in log, text
    # rltrain's own records are in the log as well (with time and logger), the step line is not
    assert re.search(r"^\S+ \S+ INFO rltrain: waiting \.\.\. done in 0\.0 s$", log, re.M)
    assert "WARNING rltrain.demo: own warning" in log and "step 1/2" not in log


def test_one_stream_keeps_the_order_when_stdout_and_stderr_are_one_file(tmp_path):
    result = run(tmp_path, "quiet", merged=True)
    assert result.returncode == 0, result.stdout
    own = [line.format(log=tmp_path / "rltrain.log") for line in OWN_STDERR]
    assert lines(result.stdout) == [*own[:-1], "step 1/2 | reward 0.500", own[-1]]


def test_verbose_shows_everything_and_still_writes_the_log(tmp_path):
    result = run(tmp_path, "verbose")
    assert result.returncode == 0, result.stderr
    log = (tmp_path / "rltrain.log").read_text()
    console = result.stdout + result.stderr
    assert "rltrain: waiting ... done in 0.0 s" in console
    for text in [*THIRD_PARTY, *C_LEVEL]:
        assert text in console, text
    for text in THIRD_PARTY:  # output of Python code; C-level writes bypass it (terminal only)
        assert text in log, text


def test_an_uncaught_error_reaches_the_terminal_with_its_traceback(tmp_path):
    result = run(tmp_path, "quiet", end="fail")
    assert result.returncode == 1
    assert "rltrain: CRITICAL: stopped by an error:" in result.stderr
    assert lines(result.stderr)[-1] == "ValueError: boom"
    assert "ValueError: boom" in (tmp_path / "rltrain.log").read_text()


@pytest.mark.parametrize(
    ("line", "own"),
    [
        ("(critic rank 1 pid=7) ERROR rltrain.workers.model_workers: x", True),
        ("(critic rank 1 pid=7, ip=10.0.0.2) WARNING rltrain: x", True),
        ("\x1b[36m(critic rank 1 pid=7)\x1b[0m WARNING rltrain.rollout.vllm.engine: x", True),
        ("(critic rank 1 pid=7) INFO rltrain.workers.model_workers: x", False),
        ("(critic rank 1 pid=7) WARNING rltrainer: x", False),
        ("(critic rank 1 pid=7) (MainProcess pid=7) WARNING 12-01 10:21:29 [arg_utils.py:1945] x", False),
        ("(critic rank 1 pid=7) /x/megatron/core/optimizer.py:28: UserWarning: x", False),
        ("WARNING rltrain.workers.model_workers: x", False),
    ],
)
def test_forwarded_worker_lines_shown_are_rltrain_warnings_and_errors(line, own):
    assert is_own_worker_line(line) is own
