"""A rank's liveness answer comes from the latest walk of /proc and never waits for one."""

import threading
import time

from rltrain.orchestrator.liveness import ChildWatch


def _eventually(watch: ChildWatch, expected) -> None:
    deadline = time.monotonic() + 10
    while (answer := watch.answer()) != expected:
        assert time.monotonic() < deadline, f"the watch still answers {answer}, not {expected}"
        time.sleep(0.01)


def test_the_answer_is_the_latest_walk_and_does_not_wait_for_the_one_under_way():
    release = threading.Event()
    walks: list[int] = []

    def walk():
        walks.append(len(walks) + 1)
        if not release.wait(10):
            raise AssertionError("never released")
        return [(100, "engine_core")]

    watch = ChildWatch(walk)
    start = time.monotonic()
    assert watch.answer() == []  # nothing walked yet
    while not walks:
        time.sleep(0.01)
    assert watch.answer() == []  # the first walk is under way (blocked): answered at once
    assert time.monotonic() - start < 5
    release.set()
    _eventually(watch, [(100, "engine_core")])
    assert len(walks) >= 2  # the answer during the first walk asked for another


def test_a_walk_that_fails_says_nothing_is_stopped_and_the_next_one_runs():
    results = iter([[(7, "sleep")], OSError("/proc went away"), [(8, "sleep")]])

    def walk():
        item = next(results, [(8, "sleep")])
        if isinstance(item, Exception):
            raise item
        return item

    watch = ChildWatch(walk)
    _eventually(watch, [(7, "sleep")])
    _eventually(watch, [(8, "sleep")])
