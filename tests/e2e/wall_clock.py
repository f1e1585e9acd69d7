"""Metric key prefixes whose values are wall-clock times, which differ between two runs of the same
seed by nature: the e2e tests that compare runs key by key leave them out (plus their own)."""

from __future__ import annotations

WALL_CLOCK = (
    "timing_s/",
    "perf/",
    "weight_sync/seconds",
    "weight_sync/verify_seconds",
    "weight_sync/receive_seconds",
)


def assert_equal_but_wall_clock(one: list[dict], many: list[dict], *, also: tuple[str, ...] = ()) -> None:
    """Equal records step by step, but for wall-clock times (and the keys starting with ``also``);
    a step redone after a restart counts once (its last record)."""
    one, many = ({r["step"]: r for r in records} for records in (one, many))
    assert sorted(one) == sorted(many)
    skip = (*WALL_CLOCK, *also)
    for step, a in one.items():
        keep = {k: v for k, v in a.items() if not k.startswith(skip)}
        assert keep == {k: v for k, v in many[step].items() if not k.startswith(skip)}, step
