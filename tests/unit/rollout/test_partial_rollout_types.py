"""Pure pieces of partial rollouts: per-token versions from vLLM's weight-version spans, streamed
outputs joined per sample, and the ``rollout.partial_rollout`` config key and its check."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rltrain.config import load_config
from rltrain.rollout.partial import SampleStreams, VersionedSample, versions_of
from tests.unit.config.recipe_helpers import MINIMAL, errors_of, write


def span(version: str, start: int, end: int) -> SimpleNamespace:
    return SimpleNamespace(version=version, start=start, end=end)


def test_versions_of_spans_tile_the_response():
    assert versions_of([span("3", 0, 2), span("5", 2, 5)], 5, request_id="r") == [3, 3, 5, 5, 5]
    assert versions_of([span("0", 0, 1)], 1, request_id="r") == [0]
    assert versions_of(None, 0, request_id="r") == []
    with pytest.raises(RuntimeError, match=r"request 'r': 3 tokens but no weight version spans"):
        versions_of(None, 3, request_id="r")
    with pytest.raises(RuntimeError, match=r"do not tile \[0, 4\)"):
        versions_of([span("1", 0, 2), span("2", 3, 4)], 4, request_id="r")  # a gap
    with pytest.raises(RuntimeError, match=r"do not tile \[0, 4\)"):
        versions_of([span("1", 0, 3)], 4, request_id="r")  # short
    with pytest.raises(RuntimeError, match=r"label 'default' is not a policy version"):
        versions_of([span("default", 0, 2)], 2, request_id="r")


def completion(index, ids, *, finish=None, spans=None, stop=None):
    """A vLLM ``CompletionOutput`` delta: logprobs as ``{token: Logprob}`` per step (logprob -token/10)."""
    steps = [{t: SimpleNamespace(logprob=-t / 10)} for t in ids]
    return SimpleNamespace(
        index=index,
        token_ids=ids,
        logprobs=steps,
        finish_reason=finish,
        stop_reason=stop,
        weight_versions=spans,
    )


def test_sample_streams_join_deltas_per_sample_in_index_order():
    streams = SampleStreams("req", 2)
    streams.add(SimpleNamespace(outputs=[completion(1, [7]), completion(0, [4, 5])]))
    assert streams.num_tokens == 3
    with pytest.raises(RuntimeError, match=r"request 'req' ended with samples \[\] of 2 finished"):
        streams.samples()
    streams.add(
        SimpleNamespace(
            outputs=[completion(0, [6], finish="length", spans=[span("0", 0, 1), span("1", 1, 3)])]
        )
    )
    streams.add(SimpleNamespace(outputs=[completion(1, [2], finish="stop", stop=2, spans=[span("1", 0, 2)])]))
    first, second = streams.samples()
    assert first == VersionedSample([4, 5, 6], [-0.4, -0.5, -0.6], [0, 1, 1], "length", None)
    assert second == VersionedSample([7, 2], [-0.7, -0.2], [1, 1], "stop", 2)
    assert (first.num_interruptions, second.num_interruptions) == (1, 0)
    assert second.as_sample().token_ids == [7, 2] and second.as_sample().stop_reason == 2


def test_sample_streams_reject_missing_logprobs():
    bad = completion(0, [1, 2])
    bad.logprobs = bad.logprobs[:1]
    with pytest.raises(RuntimeError, match="request req: 2 tokens but 1 logprobs"):
        SampleStreams("req", 1).add(SimpleNamespace(outputs=[bad]))


def test_partial_rollout_defaults_off_and_needs_the_async_engine(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL)
    assert load_config(path, []).rollout.partial_rollout is False
    assert errors_of(path, ["rollout.partial_rollout=true"]) == [
        "override 'rollout.partial_rollout=true': rollout.partial_rollout=true pauses requests in "
        "flight, which needs the asynchronous engine; set rollout.engine to async"
    ]
    config = load_config(path, ["rollout.partial_rollout=true", "rollout.engine=async"])
    assert config.rollout.partial_rollout is True and config.rollout.uses_async_engine()
