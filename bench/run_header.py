"""The first line of a bench's results file: what ran, when, at which commit, on how loaded a machine."""

from __future__ import annotations

import datetime
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_header(name: str) -> list[str]:
    """``[line]``: ``name``, the time, the short commit of this checkout, the cores and the load average."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        f"{name}: {datetime.datetime.now().isoformat(timespec='seconds')}, commit {commit}, "
        f"{os.cpu_count()} cores, load average {load} (1, 5, 15 min) at start",
    ]


def write_results(lines: list[str], *, started: float, out: Path | None) -> None:
    """Print ``lines`` with the closing load-average line (``started``: ``time.perf_counter()`` at the
    start) and write them to ``out`` when given."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [
        *lines,
        "",
        f"load average at the end {load}; the script ran {time.perf_counter() - started:.0f} s",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        out.write_text(text)
