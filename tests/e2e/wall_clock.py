"""Metric key prefixes whose values are wall-clock times, which differ between two runs of the same
seed by nature: the e2e tests that compare runs key by key leave them out (plus their own)."""

WALL_CLOCK = (
    "timing_s/",
    "perf/",
    "weight_sync/seconds",
    "weight_sync/verify_seconds",
    "weight_sync/receive_seconds",
)
