"""Partial rollouts: samples that record the policy version of every token, and batches of requests
whose weights may change while they generate.

The engine side is an asynchronous engine (:class:`~rltrain.rollout.protocol.AsyncRolloutEngine`:
``agenerate_versioned``, ``start_batch``, ``weight_update``); this module holds what it returns:

- ``VersionedSample``: a ``Sample`` plus ``versions`` (the policy version of the weights that
  sampled each token). A request that ran across a weight update has the old version on its prefix
  and the new one on the tokens sampled after the load.
- ``RolloutBatch``: requests started together from sync code; results per request as they finish,
  every wait bounded and naming the batch and its requests.
- ``versions_of``: vLLM's ``WeightVersionSpan`` list (``[start, end)`` per weight label, set by the
  engine core while generation is paused) as one version per token.
- ``BatchQueue``: the asynchronous pipeline's batches on one engine (``trainer.pipeline`` with
  ``rollout.partial_rollout=true``), generated one at a time in submission order on a thread of
  their own, so that the engine's host stays free to load weights while one generates; each batch
  comes back as a ``RolloutOutput`` with ``token_versions``.

Nothing here imports vLLM: outputs are read by attribute.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from rltrain.rollout.types import RolloutOutput, Sample, SamplingConfig

if TYPE_CHECKING:
    import numpy as np

    from rltrain.rollout.protocol import AsyncRolloutEngine

T = TypeVar("T")


@dataclass(frozen=True)
class VersionedSample:
    """One sampled response with the policy version of each token."""

    token_ids: list[int]
    """[response_len] sampled token ids, up to and including the EOS / stop token."""

    logprobs: list[float]
    """[response_len] behaviour log-probability of each token under the weights that sampled it."""

    versions: list[int]
    """[response_len] policy version (``AsyncRolloutEngine.policy_version``) of those weights;
    non-decreasing along the response."""

    finish_reason: str
    """``stop``, ``length`` or ``abort`` (see ``RolloutOutput.finish_reasons``)."""

    stop_reason: int | str | None
    """The stop token id or stop string that ended the sample; None for EOS or length."""

    routed_experts: np.ndarray | None = None
    """``Sample.routed_experts``: what the engine's MoE routers chose for prompt and response (the
    routes of tokens sampled after a weight update come from the new weights)."""

    @property
    def num_interruptions(self) -> int:
        """How many weight updates this response ran across (version changes along it)."""
        return sum(a != b for a, b in zip(self.versions, self.versions[1:]))

    def as_sample(self) -> Sample:
        """The ``Sample`` without versions."""
        return Sample(
            self.token_ids, self.logprobs, self.finish_reason, self.stop_reason, self.routed_experts
        )


def versions_of(spans: list[Any] | None, num_tokens: int, *, request_id: str) -> list[int]:
    """Per-token versions of ``num_tokens`` tokens from vLLM's ``WeightVersionSpan`` list (``version``
    a label ``str(int)``, ``[start, end)``); the spans must tile ``[0, num_tokens)`` in order."""
    if num_tokens == 0:
        return []
    if not spans:
        raise RuntimeError(f"request {request_id!r}: {num_tokens} tokens but no weight version spans")
    versions: list[int] = []
    for span in spans:
        if span.start != len(versions) or span.end <= span.start:
            raise RuntimeError(
                f"request {request_id!r}: weight version spans {spans} do not tile [0, {num_tokens})"
            )
        try:
            version = int(span.version)
        except ValueError:
            raise RuntimeError(
                f"request {request_id!r}: weight version label {span.version!r} is not a policy "
                "version (set by AsyncRolloutEngine.weight_update)"
            ) from None
        versions += [version] * (span.end - span.start)
    if len(versions) != num_tokens:
        raise RuntimeError(
            f"request {request_id!r}: weight version spans {spans} do not tile [0, {num_tokens})"
        )
    return versions


@dataclass
class SampleStreams:
    """The streamed outputs (``RequestOutputKind.DELTA``) of one request, accumulated per sample."""

    request_id: str
    n: int
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    finals: dict[int, Any] = field(default_factory=dict)
    """Per sample index: its last ``CompletionOutput`` (finish reason, weight version spans)."""

    @property
    def num_tokens(self) -> int:
        """Tokens received so far, all samples together (read from any thread)."""
        return sum(len(ids) for ids in list(self.token_ids.values()))

    def add(self, output: Any) -> None:
        """Take one streamed ``RequestOutput`` (possibly several steps merged)."""
        for completion in output.outputs:
            ids = list(completion.token_ids)
            steps = completion.logprobs or []
            if len(steps) != len(ids):
                raise RuntimeError(f"request {self.request_id}: {len(ids)} tokens but {len(steps)} logprobs")
            self.logprobs.setdefault(completion.index, []).extend(
                step[token].logprob for token, step in zip(ids, steps)
            )
            self.token_ids.setdefault(completion.index, []).extend(ids)
            if completion.finish_reason is not None:
                self.finals[completion.index] = completion

    def samples(self) -> list[VersionedSample]:
        """The ``n`` finished samples in index order."""
        if sorted(self.finals) != list(range(self.n)):
            raise RuntimeError(
                f"request {self.request_id!r} ended with samples {sorted(self.finals)} of {self.n} finished"
            )
        out = []
        for index in range(self.n):
            ids, final = self.token_ids.get(index, []), self.finals[index]
            versions = versions_of(final.weight_versions, len(ids), request_id=f"{self.request_id}[{index}]")
            out.append(
                VersionedSample(
                    ids,
                    self.logprobs.get(index, []),
                    versions,
                    final.finish_reason,
                    final.stop_reason,
                    getattr(final, "routed_experts", None),
                )
            )
        return out


class BatchWaits(Protocol):
    """How a batch waits for its requests: bounded by the engine's liveness (the vLLM backend's
    ``async_loop.EngineLoop``)."""

    def wait_first(
        self,
        pending: set[concurrent.futures.Future],
        *,
        deadline: float | None,
        timeout_s: float | None,
        what: str,
    ) -> set[concurrent.futures.Future]: ...

    def result(self, future: concurrent.futures.Future, what: str) -> Any: ...


class RolloutBatch:
    """Requests started together by ``AsyncRolloutEngine.start_batch``; request ``i`` answers
    ``prompt_ids[i]`` with ``n`` samples. Weights may be updated (``weight_update``) while it runs."""

    def __init__(
        self,
        waits: BatchWaits,
        *,
        name: str,
        prompt_ids: list[list[int]],
        streams: list[SampleStreams],
        futures: list[concurrent.futures.Future],
    ) -> None:
        self.name = name
        self.prompt_ids = prompt_ids
        self._waits = waits
        self._streams = streams
        self._futures = futures

    @property
    def num_tokens(self) -> int:
        """Tokens sampled so far, all requests together (progress; read from any thread)."""
        return sum(s.num_tokens for s in self._streams)

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def as_completed(self, *, timeout_s: float | None = None) -> Iterator[tuple[int, list[VersionedSample]]]:
        """``(request index, its samples)`` as requests finish; all within ``timeout_s`` (None: as long
        as the engine lives). A timeout raises ``TimeoutError`` naming the batch and what is left."""
        index_of = {f: i for i, f in enumerate(self._futures)}
        pending = set(self._futures)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = sorted(self._streams[index_of[f]].request_id for f in pending)
            what = f"{self.name}: {len(left)} of {len(self._futures)} requests ({', '.join(left[:4])}...)"
            done = self._waits.wait_first(pending, deadline=deadline, timeout_s=timeout_s, what=what)
            for future in sorted(done, key=index_of.__getitem__):
                pending.discard(future)
                yield index_of[future], self._waits.result(future, what)

    def results(self, *, timeout_s: float | None = None) -> list[list[VersionedSample]]:
        """Every request's samples, in request order (see ``as_completed``)."""
        out: list[list[VersionedSample] | None] = [None] * len(self._futures)
        for index, samples in self.as_completed(timeout_s=timeout_s):
            out[index] = samples
        return out  # type: ignore[return-value]


def versioned_output(
    prompt_ids: list[list[int]], samples: list[list[VersionedSample]], *, n: int
) -> RolloutOutput:
    """``RolloutOutput.from_samples`` keeping each token's version in ``token_versions``."""
    output = RolloutOutput.from_samples(prompt_ids, [[s.as_sample() for s in p] for p in samples], n=n)
    output.token_versions = [s.versions for per_prompt in samples for s in per_prompt]
    return output


class BatchQueue:
    """Batches of one ``AsyncRolloutEngine``, generated one at a time in submission order (as the
    pipeline's schedule has them: a batch waits for the one before), each on a worker thread, so
    that the caller may run ``engine.weight_update`` while a batch is in flight."""

    def __init__(self, engine: AsyncRolloutEngine) -> None:
        self.engine = engine
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="rltrain-batches"
        )
        self._batches: dict[int, concurrent.futures.Future] = {}
        self._keys = itertools.count()
        self.current: RolloutBatch | None = None
        """The batch generating now, or the last one (progress: ``num_tokens``, ``done``)."""

    def submit(self, prompts: list, sampling: SamplingConfig) -> int:
        """Queue a batch (``start_batch``'s prompts) and return its key at once."""
        key = next(self._keys)
        self._batches[key] = self._thread.submit(self._generate, prompts, sampling)
        return key

    def generating(self) -> bool:
        """Whether a batch queued here has not finished yet."""
        return any(not f.done() for f in list(self._batches.values()))

    def result(self, key: int) -> tuple[RolloutOutput, float]:
        """Batch ``key``'s output and the seconds it generated (from its start on the engine, not
        from its submission); waits as long as the engine lives (the caller bounds the wait)."""
        if key not in self._batches:
            raise KeyError(f"no batch {key} queued on this engine (or already collected)")
        return self._batches.pop(key).result()

    def _generate(self, prompts: list, sampling: SamplingConfig) -> tuple[RolloutOutput, float]:
        if self.engine.asleep:  # a validation's generate put it to sleep (rollout.free_cache_engine)
            self.engine.wake_up()
        started = time.perf_counter()
        batch = self.current = self.engine.start_batch(prompts, sampling)
        samples = batch.results()
        return versioned_output(batch.prompt_ids, samples, n=sampling.n), time.perf_counter() - started


def load_as_version(engine: AsyncRolloutEngine, version: int | None, load: Callable[[], T]) -> T:
    """Run ``load()`` (a weight load into ``engine``) as policy ``version``: inside
    ``engine.weight_update``, so that requests in flight pause (or finish) around it; a plain load
    when ``version`` is None or already the engine's (a run's first send: nothing is in flight)."""
    if version is None or version == engine.policy_version:
        return load()
    with engine.weight_update(version=version):
        return load()
