"""Run by the multi-node test: two ranks of a worker group on two nodes (pinned by their ``node_a``
and ``node_b`` resources) join a gloo process group at rank 0's address as the run's groups do, and
report the local address of every connection their group opened between them. Prints one JSON line:
``{"node_ips": [...], "pair_addresses": [[...], [...]]}``.
"""

from __future__ import annotations

import json
import sys


class GlooProbe:
    """A worker of the group: joins gloo, all-reduces once; ``pair_addresses`` after."""

    def __init__(self, info) -> None:
        from datetime import timedelta

        import psutil
        import torch
        import torch.distributed as dist

        before = {c.laddr for c in psutil.Process().net_connections("tcp")}
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{info.master_addr}:{info.master_port}",
            rank=info.rank,
            world_size=info.world_size,
            timeout=timedelta(seconds=60),
        )
        dist.all_reduce(torch.ones(1))
        self.port = info.master_port
        self.new = [
            c
            for c in psutil.Process().net_connections("tcp")
            if c.laddr not in before and c.status == psutil.CONN_ESTABLISHED
        ]

    def pair_addresses(self) -> list[str]:
        """Local addresses of the connections gloo opened to the peer (not the rendezvous store's)."""
        return sorted({c.laddr.ip for c in self.new if self.port not in (c.laddr.port, c.raddr.port)})


def main(address: str) -> None:
    import ray

    from rltrain.orchestrator.node_groups import reserve_node_groups
    from rltrain.orchestrator.worker_group import Placement, RayWorkerGroup

    ray.init(address=address, log_to_driver=False)
    bundles = [{"CPU": 1, "node_a": 0.01}, {"CPU": 1, "node_b": 0.01}]
    groups = reserve_node_groups(bundles, ((0, 1), (1, 1)), timeout_s=60)
    group = RayWorkerGroup("probe", GlooProbe, world_size=2, placement=Placement(groups))
    print(
        json.dumps(
            {"node_ips": [ip for _, ip in group.nodes], "pair_addresses": group.call("pair_addresses")}
        ),
        flush=True,
    )
    group.kill()
    groups.remove()


if __name__ == "__main__":
    main(sys.argv[1])
