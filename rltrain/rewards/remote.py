"""A reward scored by an HTTP service (``reward.remote``), for every row.

Contract: each response is one ``POST`` of the JSON object ``{"data_source", "solution_str",
"ground_truth", "extra_info"}`` (verl's four arguments; values JSON cannot hold are sent as their
``tolist()`` or ``str()``) to ``url``; the service answers ``200`` with a JSON object holding a
numeric ``score`` and any further keys (read by
:func:`~rltrain.rewards.external.result_from_answer`). At most ``max_concurrency`` requests of a
batch are in flight at once (per scoring process: each Ray scoring task of ``reward.num_workers``
has its own). ``timeout_s`` bounds each wait on the service (connecting, then each read of the
answer).

Retries: a timeout, a refused or broken connection, a ``5xx`` or a ``429`` answer is tried again,
up to ``max_retries`` more times, after ``backoff_s × 2**k`` seconds before the ``k``-th retry
(``k`` from 0). Past the last retry, or at once for another status (a ``4xx``: the request
itself is wrong) and for an answer that is not a JSON object with a numeric ``score``, the batch
stops with a one-line :class:`~rltrain.rewards.external.RewardError` naming the URL and the
(last) failure; the requests of the batch not yet sent are dropped and those in flight stop
retrying.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

from rltrain.rewards.external import RewardError, ScoreRequest, result_from_answer, shown
from rltrain.rewards.registry import RewardResult

KEY = "reward.remote"
RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})
"""HTTP statuses that mean "try again later" rather than "this request is wrong"."""


class _Transient(Exception):
    """A failure worth another try; its message says what happened."""


def _jsonable(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else str(value)


class RemoteReward:
    """Scores every row by asking the service at ``url``."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        max_concurrency: int = 16,
        correct_score: float = 1.0,
    ) -> None:
        """``correct_score``: a plain score at least this counts as correct."""
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{KEY}.url must start with http:// or https://, got {url!r}")
        if max_concurrency < 1 or max_retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError(
                f"{KEY}: need max_concurrency >= 1, max_retries >= 0, timeout_s > 0, backoff_s >= 0; got "
                f"{max_concurrency}, {max_retries}, {timeout_s}, {backoff_s}"
            )
        self.url, self.timeout_s, self.max_retries = url, timeout_s, max_retries
        self.backoff_s, self.max_concurrency, self.correct_score = backoff_s, max_concurrency, correct_score
        self.origin = f"remote reward {url}"

    def score_requests(self, requests: Sequence[ScoreRequest]) -> list[RewardResult]:
        stop = threading.Event()
        workers = min(self.max_concurrency, len(requests)) or 1
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="remote-reward") as pool:
            futures: list[Future[RewardResult]] = [pool.submit(self._score, r, stop) for r in requests]
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in futures if f in done and f.exception() is not None]
            if failed:  # the first failures, before the others were told to stop
                stop.set()
                for f in pending:
                    f.cancel()
                raise failed[0].exception()  # type: ignore[misc]
            return [f.result() for f in futures]

    def _score(self, request: ScoreRequest, stop: threading.Event) -> RewardResult:
        body = json.dumps(
            {
                "data_source": request.data_source,
                "solution_str": request.solution_str,
                "ground_truth": request.ground_truth,
                "extra_info": dict(request.extra_info),
            },
            default=_jsonable,
        ).encode()
        tries, last = 1 + self.max_retries, ""
        for attempt in range(tries):
            if attempt and stop.wait(self.backoff_s * 2 ** (attempt - 1)):
                raise RewardError(f"{self.origin}: stopped: another request of the batch failed")
            try:
                text = self._post(body)
            except _Transient as err:
                last = str(err)
                continue
            return self._read(text, request)
        raise RewardError(
            f"{self.origin}: no answer after {tries} tries ({KEY}.max_retries={self.max_retries}); "
            f"last failure: {last}"
        )

    def _post(self, body: bytes) -> str:
        """The answer's text; :class:`_Transient` for what another try may mend, RewardError else."""
        request = urllib.request.Request(
            self.url, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                return answer.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as err:
            failure = f"HTTP {err.code} {err.reason}"
            if err.code in RETRIED_STATUSES:
                raise _Transient(failure) from None
            raise RewardError(f"{self.origin}: {failure} (not retried: the request was refused)") from None
        except urllib.error.URLError as err:
            if isinstance(err.reason, TimeoutError):
                raise _Transient(f"timed out after {self.timeout_s:g} s ({KEY}.timeout_s)") from None
            raise _Transient(f"connection failed: {err.reason}") from None
        except TimeoutError:
            raise _Transient(f"timed out after {self.timeout_s:g} s ({KEY}.timeout_s)") from None
        except (OSError, http.client.HTTPException) as err:
            raise _Transient(f"connection failed: {type(err).__name__}: {err}") from None

    def _read(self, text: str, request: ScoreRequest) -> RewardResult:
        try:
            answer = json.loads(text)
        except json.JSONDecodeError as err:
            raise RewardError(f"{self.origin}: the answer is not JSON ({err.msg}): {shown(text)}") from None
        if not isinstance(answer, dict):
            raise RewardError(f"{self.origin}: the answer is not a JSON object: {shown(answer)}")
        return result_from_answer(
            answer, correct_score=self.correct_score, origin=self.origin, request=request
        )
