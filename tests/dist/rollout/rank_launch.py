"""Launch a worker script of this folder as ranks 0 and 1 of a gloo group on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rltrain.ports import HeldPort

REPO = Path(__file__).resolve().parents[3]


def run_two_ranks(worker: str, args: list[str], out: Path, *, timeout: float) -> dict:
    """Run ``python worker *args`` as ranks 0 and 1, each given ``timeout`` seconds; return (and print)
    the JSON that rank 0 wrote to ``out``. A rank that fails is reported with the tail of its log."""
    script = Path(__file__).with_name(worker)
    held = HeldPort("127.0.0.1")  # held until the ranks are done, so nothing else takes it first
    port = str(held.port)
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, str(script), *args]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        held.close()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log[-5000:]}"
    result = json.loads(out.read_text())
    print(json.dumps(result))
    return result
