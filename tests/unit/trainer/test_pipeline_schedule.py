"""The asynchronous schedule of rltrain.trainer.pipeline against hand-derived versions.

``EnginesOnAClockDouble`` stands in for the separate engines: a test double on a simulated clock, so
that a slow engine or a slow trainer is exact and costs no time (the real engines run the same
schedule in tests/e2e/orchestrator/test_pipeline_e2e.py). It runs one batch at a time in submission
order, as a Ray actor does, and refuses weights while a batch is in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from rltrain.data.loader import PromptBatch
from rltrain.data.prompt_rows import PromptExample
from rltrain.rollout.types import RolloutOutput, SamplingConfig
from rltrain.trainer.pipeline import AsyncSource, Source, _decode, _encode


@dataclass
class EnginesOnAClockDouble:
    gen_s: float
    now: float = 0.0
    busy_until: float = 0.0
    version: int = 0
    """Syncs received (the weights' version when the driver syncs after every step)."""
    generated: list[tuple[int, float, float]] = field(default_factory=list)
    """(seed, start, end) of every batch."""
    actor_version: int = 0

    def start_generate(self, prompts: list, sampling: SamplingConfig):
        start = max(self.now, self.busy_until)
        self.busy_until = start + self.gen_s
        self.generated.append((sampling.seed, start, self.busy_until))
        return _Handle(self, self.busy_until, len(prompts), sampling.n)

    def sync_weights(self, step: int) -> dict[str, float]:
        assert self.busy_until <= self.now, (
            f"weights sent at {self.now} while generating until {self.busy_until}"
        )
        return {"weight_sync/seconds": 0.0}


@dataclass
class _Handle:
    engines: EnginesOnAClockDouble
    end: float
    prompts: int
    n: int

    def done(self) -> bool:
        return self.engines.now >= self.end

    def result(self) -> tuple[RolloutOutput, float]:
        self.engines.now = max(self.engines.now, self.end)
        samples = self.prompts * self.n
        output = RolloutOutput(
            prompt_ids=[[1]] * self.prompts,
            response_ids=[[2, 3]] * samples,
            response_logprobs=[[-0.5, -0.25]] * samples,
            finish_reasons=["stop"] * samples,
            n=self.n,
            stop_reasons=[None] * samples,
        )
        return output, self.engines.gen_s


def _prompts(position: int) -> PromptBatch:
    ex = PromptExample(
        index=position, prompt="1+1", ground_truth="2", data_source="arithmetic", extra_info={}, origin="t:1"
    )
    return PromptBatch([ex], epoch=0, position=position)


def _source(engines, *, staleness: int, steps: int, cls=AsyncSource, **kw) -> Source:
    drawn = iter(range(1000))
    extra = {"max_staleness": staleness, "total_steps": steps} if cls is AsyncSource else {}
    return cls(
        engines,
        next_prompts=lambda: _prompts(next(drawn)),
        engine_prompts=lambda p: p.prompt_ids,
        sampling=lambda step: SamplingConfig(n=2, response_length=2, seed=100 + step),
        **extra,
        **kw,
    )


def _run(source: Source, engines, *, train_s: float, steps: range, updated=lambda step: True):
    """The driver's loop over ``steps``: take, train for ``train_s``, update, report, refill."""
    versions, reports = [], []
    for step in steps:
        began = engines.now
        rollout = source.take(step)
        assert rollout.step == step and rollout.prompts.position == step - 1, "batches in data order"
        engines.now += train_s
        source.after_update(step, updated=updated(step))
        reports.append(source.metrics(rollout, step, step_seconds=engines.now - began))
        versions.append(rollout.version)
        source.refill()
    return versions, reports


def _started(source: Source) -> Source:
    source.start(0)
    source.refill()
    return source


@pytest.mark.parametrize("gen_s, train_s", [(1.0, 3.0), (3.0, 1.0)])
def test_staleness_zero_is_the_sync_schedule(gen_s, train_s):
    engines = EnginesOnAClockDouble(gen_s)
    versions, reports = _run(
        _started(_source(engines, staleness=0, steps=5)), engines, train_s=train_s, steps=range(1, 6)
    )
    assert versions == [0, 1, 2, 3, 4]
    assert [r["async/staleness_max"] for r in reports] == [0.0] * 5
    # nothing overlaps: each batch starts after the step before has trained and synced
    starts = [start for _, start, _ in engines.generated]
    assert starts == [i * (gen_s + train_s) for i in range(5)]
    assert [seed for seed, _, _ in engines.generated] == [101, 102, 103, 104, 105]


@pytest.mark.parametrize("gen_s, train_s", [(1.0, 3.0), (3.0, 1.0)])
def test_one_step_off_trains_every_batch_one_version_old_whichever_side_is_slower(gen_s, train_s):
    engines = EnginesOnAClockDouble(gen_s)
    source = _started(_source(engines, staleness=1, steps=6))
    versions, reports = _run(source, engines, train_s=train_s, steps=range(1, 7))
    assert versions == [0, 0, 1, 2, 3, 4]
    assert [r["async/staleness_max"] for r in reports] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    # generation overlaps training: 6 steps of the slower side, plus one of the faster one's
    assert engines.now == pytest.approx(6 * max(gen_s, train_s) + min(gen_s, train_s))


def test_a_slow_engine_under_staleness_two():
    """Hand-derived (gen 2 s, train 1 s): batches 1-3 from version 0; the engines fall idle only when
    step 3 takes batch 3 at t=6 (weights of step 2), then batches 4-5; batch 5 ends at t=10, when
    the actor holds version 4: batches 6-7, and so on. The trainer never waits longer than needed."""
    engines = EnginesOnAClockDouble(2.0)
    versions, reports = _run(
        _started(_source(engines, staleness=2, steps=9)), engines, train_s=1.0, steps=range(1, 10)
    )
    assert versions == [0, 0, 0, 2, 2, 4, 4, 6, 6]
    staleness = [r["async/staleness_max"] for r in reports]
    assert staleness == [0, 1, 2, 1, 2, 1, 2, 1, 2] and max(staleness) <= 2
    # the last step also sends its weights: no batch is left to generate, the engines are idle
    assert [r["async/weight_syncs"] for r in reports] == [0, 0, 1, 0, 1, 0, 1, 0, 2]
    assert engines.now == pytest.approx(9 * 2.0 + 1.0), "generation-bound: the engines never idle"
    assert [r["async/engine_idle_s"] for r in reports[3:]] == [0.0] * 6
    # the trainer waits 1 s of each 2 s step for its batch (its wait is real time here: ~0)
    assert all(r["async/trainer_wait_s"] < 0.5 for r in reports)


def test_a_slow_trainer_under_staleness_two():
    """Hand-derived (gen 1 s, train 3 s): batches 1-3 from version 0; after each step the engines are
    idle, take its weights and start the batch two steps ahead of the next: batch j >= 4 is version
    j-3, staleness exactly 2."""
    engines = EnginesOnAClockDouble(1.0)
    versions, reports = _run(
        _started(_source(engines, staleness=2, steps=8)), engines, train_s=3.0, steps=range(1, 9)
    )
    assert versions == [0, 0, 0, 1, 2, 3, 4, 5]
    assert [r["async/staleness_max"] for r in reports] == [0, 1, 2, 2, 2, 2, 2, 2]
    assert engines.now == pytest.approx(1.0 + 8 * 3.0), "training-bound: the trainer waits once"
    # a batch of 1 s per 3 s step: the engines idle 2 s of each, and all of the last two steps (the
    # batch of step 8 was generated during step 6)
    assert [r["async/engine_idle_s"] for r in reports[4:]] == [2.0, 2.0, 3.0, 3.0]


def test_a_step_without_actor_update_does_not_age_the_engines():
    """Critic warm-up steps leave the actor's weights as they are: the engines hold that version
    without a weight send, and the bound counts from it."""
    engines = EnginesOnAClockDouble(1.0)
    syncs = []
    engines.sync_weights = lambda step: syncs.append(engines.now) or {}
    source = _started(_source(engines, staleness=1, steps=5))
    versions, _ = _run(source, engines, train_s=3.0, steps=range(1, 6), updated=lambda step: step > 2)
    assert versions == [0, 0, 1, 2, 3]
    assert len(syncs) == 1 + 3, "the start, then steps 3, 4 and 5 only"


def test_a_checkpoint_keeps_the_untrained_batches_and_the_resumed_schedule_repeats():
    engines = EnginesOnAClockDouble(1.0)
    whole = _started(_source(engines, staleness=1, steps=6))
    want, _ = _run(whole, engines, train_s=2.0, steps=range(1, 7))

    first_engines = EnginesOnAClockDouble(1.0)
    first = _started(_source(first_engines, staleness=1, steps=6))
    _run(first, first_engines, train_s=2.0, steps=range(1, 3))
    rollout = first.take(3)  # step 3 as the driver runs it, saved before its refill
    first_engines.now += 2.0
    first.after_update(3, updated=True)
    first.metrics(rollout, 3)
    saved = first.state()
    assert [b["step"] for b in saved] == [4] and [b["version"] for b in saved] == [2]
    resumed_engines = EnginesOnAClockDouble(1.0)
    resumed = _source(resumed_engines, staleness=1, steps=6)
    resumed.load_state(saved)
    # the data loader resumes after the saved batch's prompts (the checkpoint's data position)
    drawn = iter(range(4, 1000))
    resumed.next_prompts = lambda: _prompts(next(drawn))
    resumed.start(3)
    resumed.refill()
    got, _ = _run(resumed, resumed_engines, train_s=2.0, steps=range(4, 7))
    assert got == want[3:]
    # the saved batch round-trips exactly: what the checkpoint holds is the batch that was queued
    kept, restored = first.queue[0], _decode(saved[0])
    assert restored.output == kept.output and restored.prompts == kept.prompts
    assert _encode(restored) == saved[0]


def test_the_sync_source_trains_restored_batches_first():
    engines = EnginesOnAClockDouble(1.0)
    source = _source(engines, staleness=0, steps=3, cls=Source)
    first = _started(_source(EnginesOnAClockDouble(1.0), staleness=1, steps=3))
    _run(first, first.policy, train_s=2.0, steps=range(1, 2))
    source.load_state(first.state())
    rollout = source.take(2)
    assert (rollout.step, rollout.version, rollout.prompts.position) == (2, 0, 1)
    with pytest.raises(RuntimeError, match="next batch is step 2, not 3"):
        source.load_state(first.state())
        source.take(3)


@dataclass
class PartialEnginesDouble(EnginesOnAClockDouble):
    """Engines that take weights mid-batch (``rollout.partial_rollout``): of a batch's two samples, the
    first samples ``tokens`` tokens evenly over the batch's ``gen_s`` (token i at ``start + (i + 0.5)
    * gen_s / tokens``), the second over its second half; each token is labelled with the version of
    the last load before it."""

    tokens: int = 4
    loads: list[tuple[float, int]] = field(default_factory=list)

    def queue_generate(self, prompts: list, sampling: SamplingConfig):
        handle = self.start_generate(prompts, sampling)
        return _PartialHandle(self, handle.end, handle.prompts, handle.n)

    def sync_weights(self, step: int, *, version: int) -> dict[str, float]:
        self.loads.append((self.now, version))
        return {"weight_sync/seconds": 0.0}

    def version_at(self, when: float) -> int:
        return [v for t, v in self.loads if t <= when][-1]


@dataclass
class _PartialHandle(_Handle):
    def result(self) -> tuple[RolloutOutput, float]:
        output, seconds = super().result()
        gen_s, tokens = self.engines.gen_s, self.engines.tokens
        start = self.end - gen_s
        whole = [self.engines.version_at(start + (i + 0.5) * gen_s / tokens) for i in range(tokens)]
        late = [
            self.engines.version_at(start + gen_s / 2 + (i + 0.5) * gen_s / 2 / tokens) for i in range(tokens)
        ]
        assert self.prompts * self.n == 2
        output.response_ids = [list(range(tokens))] * 2
        output.response_logprobs = [[-0.5] * tokens] * 2
        output.token_versions = [whole, late]
        return output, seconds


@pytest.mark.parametrize("frozen", [False, True])
def test_partial_rollouts_take_weights_mid_batch_and_count_staleness_at_the_oldest_token(frozen):
    """Hand-derived (gen 2 s, train 1 s, one_step_off, 4 tokens a sample): step k's weights load at
    t = 2k + 1, halfway through batch k+1 (generating [2k, 2k+2]): its first sample's tokens at
    2k + 0.25, 0.75, 1.25, 1.75 are versions k-1, k-1, k, k; its second sample's (2k + 1.125 ...
    1.875) all k. Each batch from the second on is one version old at its oldest token (the bound);
    its samples 1 and 0 versions old, its tokens 0.25 on average. ``frozen``: steps 1 and 2 leave the
    actor as it was (critic warm-up); its weights are sent all the same, so that the engines' labels
    keep up with the actor's version. Without partial rollouts the same schedule waits for batch
    k+1 before sending (see the one_step_off test above)."""
    engines = PartialEnginesDouble(2.0)
    source = _started(_source(engines, staleness=1, steps=5, partial=True))
    updated = (lambda step: step > 2) if frozen else (lambda step: True)
    versions, reports = _run(source, engines, train_s=1.0, steps=range(1, 6), updated=updated)
    assert engines.loads == [(0.0, 0), (3.0, 1), (5.0, 2), (7.0, 3), (9.0, 4), (11.0, 5)]
    assert versions == [0, 0, 1, 2, 3]
    assert [r["async/staleness_max"] for r in reports] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [r["async/staleness_mean"] for r in reports] == [0.0, 0.5, 0.5, 0.5, 0.5]
    assert [r["async/partial_samples"] for r in reports] == [0.0, 0.5, 0.5, 0.5, 0.5]
    assert [r["async/version_spread"] for r in reports] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [r["async/token_staleness_mean"] for r in reports] == [0.0, 0.25, 0.25, 0.25, 0.25]
    # one weight send per step, each while a batch was generating (none waited for it)
    assert [r["async/weight_syncs"] for r in reports] == [1.0] * 5


def test_partial_rollout_batches_keep_their_token_versions_through_a_checkpoint():
    engines = PartialEnginesDouble(2.0)
    source = _started(_source(engines, staleness=1, steps=4, partial=True))
    _run(source, engines, train_s=1.0, steps=range(1, 2))
    # batch 2, its weights changed halfway (step 1's landed at t = 3), and batch 3 (queued after
    # that load, generated in [4, 6]): the save waits for both, each at its oldest token's version
    saved = source.state()
    assert [(b["step"], b["version"]) for b in saved] == [(2, 0), (3, 1)]
    assert [b["output"]["token_versions"] for b in saved] == [[[0, 0, 1, 1], [1] * 4], [[1] * 4] * 2]
    assert [_encode(_decode(b)) for b in saved] == saved
