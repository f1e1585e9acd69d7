"""A Ray cluster of several nodes on this machine, for the multi-node tests (``conftest.py`` runs
this script in a process of its own and talks to it over stdin/stdout).

Every node is a real raylet (its own node id, object store and worker processes) started by Ray's
``ray.cluster_utils.Cluster``: a head without CPUs (the GCS; nothing runs there), then one node per
``--node NAME:CPUS:DEVICES`` holding CPUS CPUs, DEVICES of the stand-in device resource and one of
``node_NAME`` (to pin a reservation to it). The script prints one JSON line ``{"address": ...,
"nodes": {NAME: node id}}`` once every node is alive, then answers commands, one a line:

- ``kill NAME``: kill every process of the node (its raylet and workers included) at once, as a
  machine that loses power; answers ``killed NAME <seconds>``.
- ``add NAME:CPUS:DEVICES[:EXTRA]``: start one more node (a replacement; EXTRA names one more
  ``node_EXTRA`` resource it holds); answers ``added NAME <node id>``.
- end of input (the test session is over, or it died): shut the cluster down and exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--node", action="append", required=True, help="NAME:CPUS:DEVICES")
    parser.add_argument("--device-resource", default="stand_in_gpu")
    args = parser.parse_args()

    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = {}
    try:
        for spec in args.node:
            name, node = add(cluster, spec, args.device_resource)
            nodes[name] = node
        cluster.wait_for_nodes()
        print(
            json.dumps({"address": cluster.address, "nodes": {n: node.node_id for n, node in nodes.items()}}),
            flush=True,
        )
        for line in sys.stdin:
            command, _, name = line.strip().partition(" ")
            if command == "kill" and name in nodes:
                start = time.monotonic()
                cluster.remove_node(nodes.pop(name), allow_graceful=False)
                print(f"killed {name} {time.monotonic() - start:.2f}", flush=True)
            elif command == "add":
                name, node = add(cluster, name, args.device_resource)
                nodes[name] = node
                print(f"added {name} {node.node_id}", flush=True)
            else:
                print(f"unknown command {line.strip()!r}", flush=True)
    finally:
        cluster.shutdown()
    return 0


def add(cluster, spec: str, device_resource: str):
    """Start the node ``NAME:CPUS:DEVICES[:EXTRA]`` (EXTRA: one more ``node_EXTRA`` resource, for a
    replacement standing in for a lost node); ``(NAME, node)``."""
    name, cpus, devices, *extra = spec.split(":")
    resources = {f"node_{n}": 1.0 for n in (name, *extra)}
    node = cluster.add_node(num_cpus=int(cpus), resources={**resources, device_resource: float(devices)})
    cluster.wait_for_nodes()
    return name, node


if __name__ == "__main__":
    sys.exit(main())
