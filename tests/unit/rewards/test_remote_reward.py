"""reward.remote against a local HTTP service started in a thread: what is sent and read, retries with
exponential backoff after timeouts, 5xx answers and a flaky service, one-line failures naming the
URL and the last failure, and the concurrency bound (the service counts requests in flight)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from rltrain.config.reward import RemoteRewardConfig, RewardConfig
from rltrain.rewards import RewardError, RewardManager
from rltrain.rewards.remote import RemoteReward

Answer = tuple[int, bytes, float]
"""What the service does for a request: status, body, seconds to wait before answering."""


def ok(score: float, **extra: Any) -> Answer:
    return 200, json.dumps({"score": score, **extra}).encode(), 0.0


@dataclass
class Service:
    url: str
    payloads: list[dict[str, Any]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@contextmanager
def service(answer: Callable[[int, dict[str, Any]], Answer]) -> Iterator[Service]:
    """A scoring service on 127.0.0.1; ``answer(n, payload)`` decides the ``n``-th request (from 1)."""
    release = threading.Event()  # ends the waits of slow answers at teardown

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                state.payloads.append(payload)
                state.times.append(time.monotonic())
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
                n = len(state.payloads)
            status, body, delay = answer(n, payload)
            if delay:
                release.wait(delay)
            with state.lock:  # answered from here on: the client may send its next request
                state.in_flight -= 1
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the client stopped waiting (a timeout)
                pass

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads, server.block_on_close = True, False
    state = Service(url=f"http://127.0.0.1:{server.server_address[1]}/score")
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
        assert not thread.is_alive(), "the test service did not stop within 5 s"


def remote(url: str, **kwargs: Any) -> RemoteReward:
    settings = {"timeout_s": 1.0, "max_retries": 2, "backoff_s": 0.05, "max_concurrency": 4, **kwargs}
    return RemoteReward(url, **settings)


def score(scorer: RemoteReward, responses: list[str]) -> list[float]:
    manager = RewardManager(scorer=scorer)
    return manager(
        responses, ground_truths=["g"] * len(responses), data_sources=["d"] * len(responses)
    ).scores.tolist()


def test_each_row_is_posted_with_verl_names_and_the_answer_is_its_score() -> None:
    with service(
        lambda n, p: ok(len(p["solution_str"]) / 4, acc=p["solution_str"] == p["ground_truth"])
    ) as svc:
        config = RewardConfig(remote=RemoteRewardConfig(enable=True, url=svc.url, timeout_s=2.0))
        out = RewardManager.from_config(config)(
            ["ab", "abcd"],
            ground_truths=["ab", "x"],
            data_sources=["math", "code"],
            extra_infos=[{"index": 0}, {"index": 1, "tests": [1, 2]}],
        )
    assert out.scores.tolist() == [0.5, 1.0]
    assert out.correct.tolist() == [True, False]  # the answers' acc
    assert out.metrics["reward/extra/acc/mean"] == 0.5
    assert sorted(svc.payloads, key=lambda p: p["extra_info"]["index"]) == [
        {"data_source": "math", "solution_str": "ab", "ground_truth": "ab", "extra_info": {"index": 0}},
        {
            "data_source": "code",
            "solution_str": "abcd",
            "ground_truth": "x",
            "extra_info": {"index": 1, "tests": [1, 2]},
        },
    ]


def test_a_slow_answer_past_the_timeout_is_tried_again() -> None:
    with service(lambda n, p: (200, b'{"score": 0.25}', 2.0 if n == 1 else 0.0)) as svc:
        start = time.monotonic()
        assert score(remote(svc.url, timeout_s=0.2, max_retries=1), ["r"]) == [0.25]
    assert len(svc.payloads) == 2
    assert 0.2 + 0.05 <= time.monotonic() - start < 1.5  # the timeout, the backoff, not the 2 s wait


def test_a_flaky_service_is_retried_with_exponential_backoff() -> None:
    answers = {1: (503, b"busy", 0.0), 2: (500, b"oops", 0.0)}
    with service(lambda n, p: answers.get(n, ok(0.75))) as svc:
        assert score(remote(svc.url, max_retries=2, backoff_s=0.1), ["r"]) == [0.75]
    gaps = [b - a for a, b in zip(svc.times, svc.times[1:])]
    assert len(gaps) == 2 and gaps[0] >= 0.1 and gaps[1] >= 0.2  # backoff_s, then twice it


def test_after_the_last_retry_the_error_names_the_url_and_the_last_failure() -> None:
    with service(lambda n, p: (500, b"down", 0.0)) as svc, pytest.raises(RewardError) as info:
        score(remote(svc.url, max_retries=2, backoff_s=0.01), ["r"])
    assert len(svc.payloads) == 3
    assert str(info.value) == (
        f"remote reward {svc.url}: no answer after 3 tries (reward.remote.max_retries=2); last failure: "
        "HTTP 500 Internal Server Error"
    )
    with service(lambda n, p: (200, b'{"score": 1}', 2.0)) as svc, pytest.raises(RewardError) as info:
        score(remote(svc.url, timeout_s=0.15, max_retries=1, backoff_s=0.01), ["r"])
    assert str(info.value) == (
        f"remote reward {svc.url}: no answer after 2 tries (reward.remote.max_retries=1); last failure: "
        "timed out after 0.15 s (reward.remote.timeout_s)"
    )


@pytest.mark.parametrize(
    ("status", "body", "failure"),
    [
        (404, b"no such route", "HTTP 404 Not Found (not retried: the request was refused)"),
        (200, b"oops", "the answer is not JSON (Expecting value): 'oops'"),
        (200, b"[1, 2]", "the answer is not a JSON object: [1, 2]"),
        (
            200,
            b'{"value": 1}',
            "for data_source 'd' the answer {'value': 1} has no 'score' key; a reward answers a number, "
            "a bool or a dict with a numeric 'score'",
        ),
    ],
)
def test_a_refused_request_and_bad_answers_stop_at_once_naming_the_url(status, body, failure) -> None:
    with service(lambda n, p: (status, body, 0.0)) as svc, pytest.raises(RewardError) as info:
        score(remote(svc.url), ["r"])
    assert str(info.value) == f"remote reward {svc.url}: {failure}"
    assert len(svc.payloads) == 1


def test_no_more_requests_are_in_flight_than_max_concurrency() -> None:
    with service(lambda n, p: (200, b'{"score": 1}', 0.15)) as svc:
        start = time.monotonic()
        assert score(remote(svc.url, max_concurrency=3), [str(i) for i in range(12)]) == [1.0] * 12
        elapsed = time.monotonic() - start
    assert svc.max_in_flight == 3
    assert elapsed >= 4 * 0.15  # 12 requests, 3 at a time


def test_the_first_failure_stops_the_rest_of_the_batch() -> None:
    with (
        service(
            lambda n, p: (400, b"bad", 0.0) if p["solution_str"] == "0" else (200, b'{"score": 1}', 0.1)
        ) as svc,
        pytest.raises(RewardError, match="HTTP 400 Bad Request"),
    ):
        score(remote(svc.url, max_concurrency=1), [str(i) for i in range(20)])
    assert len(svc.payloads) <= 2  # the failing first request, at most one started beside it


def test_a_service_that_is_not_there_fails_after_the_retries() -> None:
    import socket

    with socket.socket() as probe:  # a port nothing listens on once this closes
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/score"
    with pytest.raises(RewardError) as info:
        score(remote(url, max_retries=1, backoff_s=0.01), ["r"])
    assert str(info.value) == (
        f"remote reward {url}: no answer after 2 tries (reward.remote.max_retries=1); last failure: "
        "connection failed: [Errno 111] Connection refused"
    )
