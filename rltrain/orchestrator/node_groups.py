"""The run's placement groups, one per node's share of a pool, and where each rank landed.

:func:`reserve_node_groups` reserves one Ray placement group (``STRICT_PACK``: all on one node) for
each run of bundles that :func:`~rltrain.orchestrator.placement.node_groups` says must share a node,
so that rank r of a trainer role is on its pool's node r // n_gpus_per_node with its tensor-parallel
peers, and an engine's devices are on one node. :class:`NodeGroups` maps the run's bundle index to
(placement group, index in it). On one node every group lands on it, as the single group of the
past did.

:func:`placement_record` is what the run writes to ``placement.json`` in its run directory and logs:
each role's ranks with the node (id and address) and process they run in, and where each rollout
engine runs (a colocated engine in its host rank's process tree, on that rank's node).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeGroups:
    """Placement groups over the run's ``bundles``: ``groups[i]`` holds bundles ``cuts[i]``
    (``(first, count)``)."""

    groups: tuple[PlacementGroup, ...]
    cuts: tuple[tuple[int, int], ...]
    bundles: tuple[dict[str, float], ...]

    def locate(self, index: int) -> tuple[PlacementGroup, int]:
        """The placement group holding the run's bundle ``index``, and the bundle's index in it."""
        for group, (first, count) in zip(self.groups, self.cuts):
            if first <= index < first + count:
                return group, index - first
        raise IndexError(f"bundle {index} is in none of the run's placement groups {self.cuts}")

    def wait_placed(self, timeout_s: float, *, again: bool = False) -> None:
        """Wait until Ray has placed every group (after a node's loss Ray places the groups that were
        on it again where they fit, or waits for a node that can hold them); raises
        :class:`~rltrain.orchestrator.worker_group.PlacementTimeout` naming the groups not placed
        within ``timeout_s`` (``trainer.timeouts.init_s``) and what each node has."""
        from rltrain.orchestrator.worker_group import PlacementTimeout

        deadline, said = time.monotonic() + timeout_s, False
        # Ray's table says when a group's bundles are committed (pg.wait would start a worker
        # process to find out, a second or more on a loaded machine)
        while pending := self._pending(check_nodes=again):
            if time.monotonic() >= deadline:
                raise PlacementTimeout(
                    f"Ray could not place the run's {self._named(pending)} on one node "
                    f"{'again ' if again else ''}within {timeout_s:g} s (trainer.timeouts.init_s); "
                    f"the cluster's nodes have {_node_resources()} (other jobs may hold part of them)"
                )
            if again and not said:
                log.warning(
                    "waiting up to %g s for Ray to place the run's %s again (trainer.timeouts.init_s)",
                    timeout_s,
                    self._named(pending),
                )
                said = True
            time.sleep(0.1)

    def _pending(self, *, check_nodes: bool) -> list[int]:
        """Indices of the groups not placed; with ``check_nodes``, also those placed on a node that is
        gone (the GCS marks a lost node dead, and moves its groups, only after its health checks
        fail: 15 s and more, while new ranks would go to the dead node)."""
        tables = [ray.util.placement_group_table(g) for g in self.groups]
        pending = [i for i, table in enumerate(tables) if table.get("state") != "CREATED"]
        if check_nodes:
            nodes = {
                n for i, t in enumerate(tables) if i not in pending for n in t["bundles_to_node_id"].values()
            }
            gone = {n for n in nodes if node_gone(n)}
            pending += [
                i
                for i, t in enumerate(tables)
                if i not in pending and gone & set(t["bundles_to_node_id"].values())
            ]
        return sorted(pending)

    def _named(self, indices: list[int]) -> str:
        return "; ".join(
            f"bundles {f}..{f + n - 1} {list(self.bundles[f : f + n])}"
            for f, n in (self.cuts[i] for i in indices)
        )

    def remove(self) -> None:
        for group in self.groups:
            ray.util.remove_placement_group(group)


def reserve_node_groups(
    bundles: list[dict[str, float]], cuts: tuple[tuple[int, int], ...], *, timeout_s: float
) -> NodeGroups:
    """Placed groups of ``bundles``, one per cut (each on one node; :meth:`NodeGroups.wait_placed`),
    released again when they are not all placed in time."""
    # Ray places pending groups one at a time, each where it fits first: the largest go first, so
    # that small groups do not split up the nodes a large one needs (measured: one device groups
    # created first took the two-device node that the critic's two-device pool needed, and the run
    # waited for its init_s)
    size = [sum(v for b in bundles[f : f + n] for k, v in b.items() if k != "CPU") for f, n in cuts]
    order = sorted(range(len(cuts)), key=lambda i: (-size[i], -cuts[i][1], i))
    created = {i: placement_group(bundles[cuts[i][0] : sum(cuts[i])], strategy="STRICT_PACK") for i in order}
    reserved = NodeGroups(tuple(created[i] for i in range(len(cuts))), cuts, tuple(bundles))
    try:
        reserved.wait_placed(timeout_s)
    except BaseException:
        reserved.remove()
        raise
    return reserved


def node_gone(node_id: str, *, timeout_s: float = 2.0) -> bool:
    """Whether the Ray node ``node_id`` is lost: the GCS says it is dead, or its raylet does not
    accept a connection within ``timeout_s`` (the GCS notices a lost node only after its health
    checks fail, 15 s or more; the raylet's port tells at once)."""
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
    return node is None or not _answers(node, timeout_s)


def _answers(node: dict, timeout_s: float = 2.0) -> bool:
    """Whether the node of ``ray.nodes()`` entry ``node`` is alive and its raylet takes a connection."""
    import socket

    if not node["Alive"]:
        return False
    try:
        socket.create_connection(
            (node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=timeout_s
        ).close()
    except OSError:
        return False
    return True


def _node_resources() -> list[dict[str, float]]:
    """The CPUs and GPUs of each live node that has any (a node whose raylet is gone is not live,
    whatever the GCS still says)."""
    return [
        {k: v for k, v in node["Resources"].items() if k in ("CPU", "GPU")}
        for node in ray.nodes()
        if node["Resources"].get("CPU", 0) + node["Resources"].get("GPU", 0) and _answers(node)
    ]


def placement_record(groups: dict, engine_ranks: tuple[int, ...]) -> dict:
    """Where the run's ranks are: ``{role: [{rank, node_id, node_ip, pid}, ...]}`` for every
    started role group (``groups``: role -> :class:`RayWorkerGroup`), and ``engines``: each rollout
    engine's node, ``{engine, node_id, host}`` (``host``: the trainer rank whose process runs a
    colocated engine (``engine_ranks``), or the separate engine's own rollout rank)."""
    record: dict = {}
    for role, group in groups.items():
        record[role] = [
            {"rank": rank, "node_id": node_id, "node_ip": node_ip, "pid": pid}
            for rank, (pid, (node_id, node_ip)) in enumerate(zip(group.pids, group.nodes))
        ]
    if "rollout" in groups:
        record["engines"] = [
            {"engine": i, "node_id": rank["node_id"], "host": f"rollout rank {rank['rank']}"}
            for i, rank in enumerate(record["rollout"])
        ]
    elif "actor_rollout_ref" in record:
        policy = record["actor_rollout_ref"]
        record["engines"] = [
            {"engine": i, "node_id": policy[r]["node_id"], "host": f"actor_rollout_ref rank {r}"}
            for i, r in enumerate(engine_ranks)
        ]
    return record


def placement_lines(record: dict) -> list[str]:
    """One line per role: its ranks grouped by node, e.g. ``actor_rollout_ref: ranks 0-1 on node
    1f3a9c0b (10.0.0.5)``."""
    lines = []
    for role, ranks in record.items():
        if role == "engines":
            continue
        by_node: dict[tuple[str, str], list[int]] = {}
        for rank in ranks:
            by_node.setdefault((rank["node_id"], rank["node_ip"]), []).append(rank["rank"])
        where = "; ".join(
            f"rank{'s' if len(r) > 1 else ''} {_span(r)} on node {node[:8]} ({ip})"
            for (node, ip), r in by_node.items()
        )
        lines.append(f"placement: {role}: {where}")
    return lines


def _span(ranks: list[int]) -> str:
    return (
        f"{ranks[0]}-{ranks[-1]}"
        if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1))
        else ",".join(map(str, ranks))
    )


def bind_gloo_to_node_address() -> str | None:
    """Make gloo bind this rank's sockets to the interface of its Ray node's address
    (``GLOO_SOCKET_IFNAME``, unless set already); returns the interface, or None when none holds it.
    By default gloo binds to the address the hostname resolves to, 127.0.0.1 in many containers
    (here too): a rank on another host would then be told to connect to its own loopback."""
    import socket

    import psutil

    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return os.environ["GLOO_SOCKET_IFNAME"]
    address = ray.util.get_node_ip_address()
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return name
    log.warning("no network interface holds this node's address %s: gloo binds where it chooses", address)
    return None
