"""The multi-node Ray cluster on this machine (``cluster_host.py``), started once for the module's
tests: node ``a`` with two stand-in devices, nodes ``b`` and ``c`` with one each, four CPUs each (the
engines, reward tasks and role processes share the machine's two cores). Runs join it through
``RAY_ADDRESS`` as a user's ``rltrain train`` on a cluster does, in a process of their own (this
process keeps its own local Ray for the one-node reference runs).

``kill(node)`` kills every process of a node at once (the node-loss test, the module's last).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.conftest import STAND_IN_GPU

HOST = Path(__file__).with_name("cluster_host.py")
START_TIMEOUT_S = 120


@dataclass
class RayNodes:
    address: str
    node_ids: dict[str, str]
    """Node name (``a``, ``b``) -> Ray's node id (killed nodes' too)."""
    process: subprocess.Popen = field(repr=False)
    killed: set[str] = field(default_factory=set)

    def name_of(self, node_id: str) -> str:
        return next(name for name, nid in self.node_ids.items() if nid == node_id)

    def env(self) -> dict[str, str]:
        return {**os.environ, "RAY_ADDRESS": self.address, "PYTHONUNBUFFERED": "1"}

    def add(self, spec: str) -> str:
        """Start the node ``NAME:CPUS:DEVICES[:EXTRA]`` (``cluster_host.py``); its node id."""
        self.process.stdin.write(f"add {spec}\n")
        self.process.stdin.flush()
        reply = _read_line(self.process, 120, f"adding node {spec}").split()
        assert reply[:2] == ["added", spec.split(":")[0]], reply
        self.node_ids[reply[1]] = reply[2]
        return reply[2]

    def kill(self, node: str) -> float:
        """Kill every process of ``node`` (its raylet and workers) at once; the seconds it took."""
        self.process.stdin.write(f"kill {node}\n")
        self.process.stdin.flush()
        reply = _read_line(self.process, 60, f"killing node {node}").split()
        assert reply[:2] == ["killed", node], reply
        self.killed.add(node)
        return float(reply[2])

    def alive(self) -> list[str]:
        return [name for name in self.node_ids if name not in self.killed]


@pytest.fixture(scope="module")
def ray_nodes():
    process = subprocess.Popen(
        [
            sys.executable,
            str(HOST),
            "--node",
            "a:4:2",
            "--node",
            "b:4:1",
            "--node",
            "c:4:1",
            "--device-resource",
            STAND_IN_GPU,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    try:
        first = _read_line(process, START_TIMEOUT_S, "the multi-node cluster's start")
        started = json.loads(first)
        yield RayNodes(started["address"], started["nodes"], process)
    finally:
        process.stdin.close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def _read_line(process: subprocess.Popen, timeout_s: float, what: str) -> str:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(process.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            process.kill()
            raise TimeoutError(f"{what} printed nothing within {timeout_s:g} s")
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"{what}: the cluster host exited ({process.wait()})")
    return line
