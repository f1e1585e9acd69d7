"""Run by the multi-node test: holds one placement group of the run's kind (``reserve_node_groups``)
pinned to the node holding the ``node_x`` resource, then answers ``wait SECONDS`` lines with what
:meth:`NodeGroups.wait_placed` (``again=True``, as a restart after a node's loss calls it) does:
``probe: placed <node id>`` or ``probe: timeout <its one-line message>`` (Ray prints lines of its
own on this process's output too).
"""

from __future__ import annotations

import sys


def main(address: str, device_resource: str) -> None:
    import ray
    from ray.util.placement_group import placement_group_table

    from rltrain.orchestrator.node_groups import reserve_node_groups
    from rltrain.orchestrator.worker_group import PlacementTimeout

    ray.init(address=address, log_to_driver=False)
    groups = reserve_node_groups([{"CPU": 1, device_resource: 1, "node_x": 0.01}], ((0, 1),), timeout_s=60)
    print("probe: placed", placement_group_table(groups.groups[0])["bundles_to_node_id"][0], flush=True)
    for line in sys.stdin:
        seconds = float(line.split()[1])
        try:
            groups.wait_placed(seconds, again=True)
        except PlacementTimeout as err:
            print("probe: timeout", str(err), flush=True)
            continue
        print("probe: placed", placement_group_table(groups.groups[0])["bundles_to_node_id"][0], flush=True)
    groups.remove()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
