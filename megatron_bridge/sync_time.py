"""The time model of a weight-sync plan (``megatron_bridge.sync_plan``): predicted seconds from
stated per-GPU bandwidths, the lower bound and node floor it is judged against, and a plan's totals.

A GPU's time in a phase is its busiest link direction (both link classes and both directions run
at once) plus its calls' latency plus its packing copies; a phase is its slowest GPU plus a relay
chain's fill; phases add up. Pure arithmetic.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from megatron_bridge.sync_plan import LINKS, GpuTraffic, Phase, Placement, SyncPlan


@dataclass(frozen=True)
class Bandwidths:
    """The time model's constants (per GPU, per direction)."""

    nvlink: float = 450e9
    net: float = 50e9
    memcpy: float = 1.5e12
    """Bytes a GPU copies per second (HBM read + write: half its HBM bandwidth)."""
    latency: float = 20e-6
    """Seconds of each call on each GPU it involves."""


def gpu_seconds(g: GpuTraffic, bw: Bandwidths) -> float:
    """One GPU's time in a phase: its busiest link direction (links and directions run at once),
    plus its calls' latency, plus its packing copies."""
    speed = {"nvlink": bw.nvlink, "net": bw.net}
    wire = max([g.sent[k] / speed[k] for k in LINKS] + [g.received[k] / speed[k] for k in LINKS])
    return wire + g.messages * bw.latency + g.packed / bw.memcpy


def phase_seconds(phase: Phase, bw: Bandwidths) -> float:
    """The slowest GPU of the phase, plus the chain's fill when there is one."""
    fill = phase.pipeline_fill_bytes / (bw.nvlink if phase.pipeline_fill_link == "nvlink" else bw.net)
    return max((gpu_seconds(g, bw) for g in phase.gpus.values()), default=0.0) + fill


def predicted_seconds(plan: SyncPlan, bw: Bandwidths) -> float:
    return sum(phase_seconds(p, bw) for p in plan.phases)


def lower_bound_seconds(plan: SyncPlan, bw: Bandwidths) -> float:
    """The largest engine GPU's bytes at network speed: with the trainer on other nodes, each byte
    an engine GPU needs crosses the network (into that GPU, or into a GPU of its node)."""
    return max(plan.need.values()) / bw.net


def node_floor_seconds(plan: SyncPlan, place: Placement, bw: Bandwidths) -> float:
    """A floor for any plan: the distinct bytes an engine node needs (replicas on one node need one
    copy), brought in over all its GPUs' network links at once, and what a GPU needs beyond its
    network share, spread inside the node over NVLink (the two overlap)."""
    needs: dict[int, dict[tuple[int, int], int]] = defaultdict(dict)
    gpus: dict[int, int] = defaultdict(int)
    largest: dict[int, int] = defaultdict(int)
    for gpu, nbytes in plan.need.items():
        node = place.node(gpu)
        needs[node][plan.position[gpu]] = nbytes
        gpus[node] += 1
        largest[node] = max(largest[node], nbytes)
    floor = 0.0
    for node, distinct in needs.items():
        share = sum(distinct.values()) / gpus[node]
        floor = max(floor, share / bw.net, max(0.0, largest[node] - share) / bw.nvlink)
    return floor


@dataclass(frozen=True)
class Summary:
    """Totals and per-GPU maxima of a plan (phases added up per GPU)."""

    max_sent: dict[str, int]
    max_received: dict[str, int]
    total_sent: dict[str, int]
    max_messages: int
    """Calls the busiest GPU takes part in."""
    calls: int
    """Calls of the whole sync (a message or a collective counted once)."""
    max_extra: int
    max_extra_gpu: int


def summarize(plan: SyncPlan) -> Summary:
    sent: dict[int, dict[str, int]] = defaultdict(lambda: dict.fromkeys(LINKS, 0))
    received: dict[int, dict[str, int]] = defaultdict(lambda: dict.fromkeys(LINKS, 0))
    messages: dict[int, int] = defaultdict(int)
    extra: dict[int, int] = defaultdict(int)
    for phase in plan.phases:
        for gpu, g in phase.gpus.items():
            for k in LINKS:
                sent[gpu][k] += g.sent[k]
                received[gpu][k] += g.received[k]
            messages[gpu] += g.messages
            extra[gpu] = max(extra[gpu], g.extra)
    top = max(extra, key=lambda gpu: (extra[gpu], -gpu)) if extra else 0
    return Summary(
        max_sent={k: max((s[k] for s in sent.values()), default=0) for k in LINKS},
        max_received={k: max((r[k] for r in received.values()), default=0) for k in LINKS},
        total_sent={k: sum(s[k] for s in sent.values()) for k in LINKS},
        max_messages=max(messages.values(), default=0),
        calls=sum(p.calls for p in plan.phases),
        max_extra=extra[top] if extra else 0,
        max_extra_gpu=top,
    )
