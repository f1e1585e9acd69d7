"""Console checks of the orchestrator tests (the shared local Ray, ``local_ray`` and ``ray_env``, is
in tests/e2e/conftest.py).

``assert_console_is_rltrain_only`` checks what a run printed: only rltrain's own lines, while the
run's log files hold the libraries' output.
"""

import re
from pathlib import Path

import pytest

# A console line of rltrain's own: a status or log line ("rltrain: ...", "rltrain[rank 1]: ..."),
# a step line, or a warning/error of an rltrain logger that Ray forwarded from a worker.
OWN_CONSOLE_LINE = re.compile(
    r"^(?:rltrain(?:\[rank \d+\])?: |step \d+/\d+(?: \||$)|\([^()]*\) (?:WARNING|ERROR|CRITICAL) rltrain[.\w]*: )"
)
# What the libraries print in every quickstart run: Megatron's Python warnings (Transformer Engine
# and Apex missing) and vLLM's INFO line after every weight load.
LIBRARY_NOISE = (
    re.compile(r"megatron/core/\S+\.py:\d+: UserWarning"),
    re.compile(r"INFO .*Successfully reset prefix cache"),
)


@pytest.fixture
def assert_console_is_rltrain_only():
    def check(console: str, run_logs: list[Path]) -> None:
        stray = [line for line in console.splitlines() if line.strip() and not OWN_CONSOLE_LINE.match(line)]
        assert not stray, "lines of other libraries on the console:\n" + "\n".join(stray[:20])
        logged = "".join(path.read_text() for path in run_logs)
        for noise in LIBRARY_NOISE:
            assert noise.search(logged), f"{noise.pattern!r} missing from {[str(p) for p in run_logs]}"
            assert not noise.search(console), noise.pattern

    return check
