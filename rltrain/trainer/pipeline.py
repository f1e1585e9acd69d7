"""Where a step's rollout comes from (``trainer.pipeline``): generated at the step (``sync``), or on
the separate engines while the trainer trains on an earlier batch (``one_step_off``, ``fully_async``).

Versions: the weights after step v are policy version v (0: the weights the run started with). A
batch carries the version its engines held when they generated it; trained at step t, whose weights
are version t-1, its staleness is t-1-v. ``sync`` trains every batch at staleness 0.

The asynchronous schedule, with the bound s (``trainer.max_staleness``; ``one_step_off`` is s = 1):

- The batch of step j is submitted to the engines once they hold version j-1-s or newer, so no
  batch is ever trained staler than s; batches are submitted in step order and queue on the engines
  (an engine runs one call at a time), drawing their prompts from the data loader as they go.
- ``rollout.partial_rollout=false``: the engines take new weights only between batches: whenever
  none is in flight and they lag the actor, the actor's weights are sent (after the step's update,
  and again right after the trainer took its batch, when the engines may just have finished).
  Validation first waits for the batches in flight and brings the engines to the actor's version:
  it always scores the trained weights.
- ``rollout.partial_rollout=true``: the actor's weights are sent as soon as they are ready, after
  every step's update (an update that changed nothing re-sends them, so that the engines' version
  labels follow the actor's), whether or not a batch is generating. The engines generate the queued
  batches one at a time, as before, on a thread of their own
  (:class:`~rltrain.rollout.partial.BatchQueue`), so they can take the weights mid-batch
  (``AsyncRolloutEngine.weight_update``): the requests in flight pause, keep their tokens and
  behaviour log-probs, and continue from their prefix on the new weights. Every token records the
  version that sampled it (``RolloutOutput.token_versions``, non-decreasing along a response). The
  behaviour log-probs that rollout correction reads (``response_logprobs``) are those of the
  weights that sampled each token. Validation waits for the batches in flight, as above.
- s = 0 submits each batch after the weight sync of the step before, the ``sync`` schedule. s = 1 is
  deterministic: the batch of step j+1 is always generated with version j-1, whichever side is
  faster. With s > 1 the version a batch gets depends on when the engines fall idle. With partial
  rollouts, where in a batch the weights change depends on timing (for any s >= 1).

Staleness per token (partial rollouts; as verl and slime count it): a sample's version is that of
its oldest token, and a batch's (``Rollout.version``) that of its oldest sample. The bound applies
to the oldest token: trained at step t, every token's version is at least t-1-s. It holds by the
schedule, since a token is never older than the weights its batch was submitted under. The
``async/staleness_*`` metrics are over samples, each at its oldest token's staleness (without
partial rollouts every sample has the batch's version: the metrics are as before); partial rollouts
add ``async/partial_samples`` (the fraction of samples that ran across a weight update),
``async/version_spread`` (newest minus oldest token version in the batch) and
``async/token_staleness_mean`` (over the tokens).

Checkpoints: batches generated but not trained are saved with the step's checkpoint
(``pipeline.json``: the save waits for those in flight) and trained after a resume exactly as they
would have been, so a resumed ``one_step_off`` run repeats the metrics of an uninterrupted one.
With partial rollouts the rule is the same: the batches saved keep their tokens, log-probs and
per-token versions; those generated after the resume take their weight updates where the timing puts
them (as any s > 1 run's batches take their versions).

Every wait is bounded: a batch by ``trainer.timeouts.generate_s`` naming the engines that did not
answer (:class:`~rltrain.orchestrator.worker_group.WorkerTimeout`).
"""

from __future__ import annotations

import base64
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rltrain.data.loader import PromptBatch, PromptExample
from rltrain.logging import metrics as mk
from rltrain.rollout.types import RolloutOutput, SamplingConfig

if TYPE_CHECKING:
    from rltrain.trainer.roles import PendingRollout, PolicyRole

PIPELINE_FILE = "pipeline.json"
"""The untrained batches of an asynchronous run, in its step checkpoints."""


@dataclass
class Rollout:
    """One step's prompts and what the engines generated for them."""

    step: int
    prompts: PromptBatch
    output: RolloutOutput
    version: int
    """Policy version of the weights that generated it."""


class Source:
    """Gives each step its rollout and keeps the engines' weights current (``sync``)."""

    def __init__(
        self,
        policy: PolicyRole,
        *,
        next_prompts: Callable[[], PromptBatch],
        engine_prompts: Callable[[PromptBatch], list],
        sampling: Callable[[int], SamplingConfig],
    ) -> None:
        """``next_prompts``: the data loader's next batch; ``engine_prompts``: what the engines are
        handed for it; ``sampling``: the sampling settings of a step (its seed)."""
        self.policy = policy
        self.next_prompts, self.engine_prompts, self.sampling = next_prompts, engine_prompts, sampling
        self.restored: deque[Rollout] = deque()
        """Untrained batches of the checkpoint resumed from, trained first."""
        self.actor_version = 0

    def start(self, step: int) -> dict[str, float]:
        """Put the actor's weights (those after ``step``) into the engines."""
        self.actor_version = step
        return self.policy.sync_weights(step)

    def take(self, step: int) -> Rollout:
        if self.restored:
            return self._restored(step)
        prompts = self.next_prompts()
        output = self.policy.generate(self.engine_prompts(prompts), self.sampling(step))
        return Rollout(step, prompts, output, version=step - 1)

    def _restored(self, step: int) -> Rollout:
        rollout = self.restored.popleft()
        if rollout.step != step:
            raise RuntimeError(
                f"{PIPELINE_FILE}: the checkpoint's next batch is step {rollout.step}, not {step}"
            )
        return rollout

    def after_update(self, step: int, *, updated: bool) -> dict[str, float]:
        """The step's update is done (``updated``: the actor's weights changed)."""
        self.actor_version = step
        return self.policy.sync_weights(step) if updated else {}

    def ensure_current(self) -> None:
        """The engines hold the actor's weights (before a validation)."""

    def refill(self) -> None:
        """Start what the schedule allows (after the step's validation and checkpoint)."""

    def metrics(self, rollout: Rollout, step: int, *, step_seconds: float | None = None) -> dict[str, float]:
        """The step's report on the schedule (``step_seconds``: the step's wall time)."""
        return {}

    def state(self) -> list[dict] | None:
        """The untrained batches a checkpoint must keep; None: nothing to save."""
        return [_encode(r) for r in self.restored] or None

    def load_state(self, batches: list[dict]) -> None:
        self.restored = deque(_decode(b) for b in batches)


@dataclass
class _InFlight:
    step: int
    prompts: PromptBatch
    version: int
    pending: PendingRollout | None
    output: RolloutOutput | None = None
    engine_seconds: float = 0.0


class AsyncSource(Source):
    """``one_step_off`` and ``fully_async``: the schedule of the module doc."""

    def __init__(
        self, policy: PolicyRole, *, max_staleness: int, total_steps: int, partial: bool = False, **kwargs
    ) -> None:
        """``partial``: ``rollout.partial_rollout`` (weights sent while batches generate)."""
        super().__init__(policy, **kwargs)
        self.max_staleness, self.total_steps, self.partial = max_staleness, total_steps, partial
        self.queue: deque[_InFlight] = deque()
        self.next_step = 1
        self.engine_version = 0
        self.trainer_wait_s = 0.0
        self.engine_busy_s = 0.0
        self.weight_syncs = 0
        self.sync_metrics: dict[str, float] = {}
        """The ``weight_sync/*`` metrics of the sends since the last report (the larger value of each
        when there were two): a send happens where the engines fall idle, in the step or its take."""

    def start(self, step: int) -> dict[str, float]:
        if self.partial:
            self.actor_version = step
            metrics = self.policy.sync_weights(step, version=step)
        else:
            metrics = super().start(step)
        self.engine_version = step
        self.next_step = step + 1 + len(self.restored)
        self.queue = deque(_InFlight(r.step, r.prompts, r.version, None, r.output) for r in self.restored)
        self.restored = deque()
        return metrics

    # --------------------------------------------------------------------------------- schedule
    def take(self, step: int) -> Rollout:
        if not self.queue:
            self._sync(wait=True)
            self.refill()
        head = self.queue[0]
        if head.step != step:
            raise RuntimeError(f"the pipeline's next batch is step {head.step}, not {step}")
        self._finish(head)
        self.queue.popleft()
        self._sync(wait=False)
        self.refill()
        return Rollout(step, head.prompts, head.output, head.version)

    def after_update(self, step: int, *, updated: bool) -> dict[str, float]:
        behind = self.engine_version < self.actor_version
        self.actor_version = step
        if not updated and not behind and not self.partial:
            self.engine_version = step  # the weights did not change: the engines hold version step
            return {}
        self._sync(wait=False)  # its weight_sync/* metrics: see :meth:`metrics`
        return {}

    def ensure_current(self) -> None:
        self._sync(wait=True)  # its weight_sync/* metrics go with the next step's report

    def refill(self) -> None:
        while (
            self.next_step <= self.total_steps
            and self.next_step - 1 - self.engine_version <= self.max_staleness
        ):
            step = self.next_step
            prompts = self.next_prompts()
            start = self.policy.queue_generate if self.partial else self.policy.start_generate
            pending = start(self.engine_prompts(prompts), self.sampling(step))
            self.queue.append(_InFlight(step, prompts, self.engine_version, pending))
            self.next_step += 1

    def _sync(self, *, wait: bool) -> None:
        """Send the actor's weights when the engines lag it and have no batch in flight (``wait``:
        wait for the batches in flight first); with partial rollouts, batches in flight or not."""
        if self.engine_version >= self.actor_version:
            return
        in_flight = [b for b in self.queue if b.output is None]
        if not wait and not self.partial and not all(b.pending.done() for b in in_flight):
            return
        if wait or not self.partial:
            for batch in in_flight:
                self._finish(batch)
        self.engine_version = self.actor_version
        self.weight_syncs += 1
        version = {"version": self.actor_version} if self.partial else {}
        for key, value in self.policy.sync_weights(self.actor_version, **version).items():
            self.sync_metrics[key] = max(self.sync_metrics.get(key, value), value)

    def _finish(self, batch: _InFlight) -> None:
        if batch.output is not None:
            return
        started = time.perf_counter()
        batch.output, batch.engine_seconds = batch.pending.result()
        batch.version = oldest_version(batch.output, default=batch.version)
        self.trainer_wait_s += time.perf_counter() - started
        self.engine_busy_s += batch.engine_seconds
        batch.pending = None

    # ---------------------------------------------------------------------------------- reports
    def metrics(self, rollout: Rollout, step: int, *, step_seconds: float | None = None) -> dict[str, float]:
        """The step's schedule: the batch's staleness, the engines' version and queue, how long the
        trainer waited for batches or for the engines before a weight send, how long the engines
        generated (as they measured it, batches finished since the last report) and, given the
        step's wall time, how long they did not (per step on average over a run; one step's
        figure may count a batch that ran mostly during the step before)."""
        staleness = float(step - 1 - rollout.version)
        if staleness > self.max_staleness:
            raise RuntimeError(
                f"step {step} trains a batch of policy version {rollout.version}: staleness {staleness:g} "
                f"exceeds trainer.max_staleness={self.max_staleness}"
            )
        out = {
            mk.ASYNC_STALENESS_MEAN: staleness,
            mk.ASYNC_STALENESS_MAX: staleness,
            **token_staleness_metrics(rollout, step),
            mk.ASYNC_ENGINE_VERSION: float(self.engine_version),
            mk.ASYNC_BATCHES_AHEAD: float(len(self.queue)),
            mk.ASYNC_TRAINER_WAIT_S: self.trainer_wait_s,
            mk.ASYNC_ENGINE_BUSY_S: self.engine_busy_s,
            mk.ASYNC_WEIGHT_SYNCS: float(self.weight_syncs),
        }
        if step_seconds is not None:
            out[mk.ASYNC_ENGINE_IDLE_S] = max(0.0, step_seconds - self.engine_busy_s)
        out |= self.sync_metrics
        self.trainer_wait_s = self.engine_busy_s = 0.0
        self.weight_syncs, self.sync_metrics = 0, {}
        return out

    def state(self) -> list[dict] | None:
        for batch in self.queue:
            self._finish(batch)
        return [_encode(Rollout(b.step, b.prompts, b.output, b.version)) for b in self.queue]


def build_source(config, policy: PolicyRole, *, total_steps: int, **kwargs) -> Source:
    """The source of ``config.trainer.pipeline``."""
    trainer = config.trainer
    if trainer.pipeline == "sync":
        return Source(policy, **kwargs)
    staleness = 1 if trainer.pipeline == "one_step_off" else trainer.max_staleness
    return AsyncSource(
        policy,
        max_staleness=staleness,
        total_steps=total_steps,
        partial=config.rollout.partial_rollout,
        **kwargs,
    )


# ------------------------------------------------------------------------------- per-token versions
def oldest_version(output: RolloutOutput, *, default: int) -> int:
    """The version of the oldest token of ``output`` (``default``: without per-token versions, or
    no tokens at all)."""
    if output.token_versions is None:
        return default
    return min((v[0] for v in output.token_versions if v), default=default)


def token_staleness_metrics(rollout: Rollout, step: int) -> dict[str, float]:
    """Staleness at ``step`` per sample (its oldest token) and per token, and how many samples ran
    across a weight update (none without per-token versions: the batch's staleness says it all)."""
    versions = rollout.output.token_versions
    if versions is None:
        return {}
    samples = [float(step - 1 - (v[0] if v else rollout.version)) for v in versions]
    tokens = [step - 1 - x for v in versions for x in v]
    newest = max((v[-1] for v in versions if v), default=rollout.version)
    return {
        mk.ASYNC_STALENESS_MEAN: sum(samples) / len(samples),
        mk.ASYNC_STALENESS_MAX: max(samples),
        mk.ASYNC_PARTIAL_SAMPLES: sum(bool(v) and v[0] != v[-1] for v in versions) / len(versions),
        mk.ASYNC_VERSION_SPREAD: float(newest - rollout.version),
        mk.ASYNC_TOKEN_STALENESS_MEAN: sum(tokens) / len(tokens) if tokens else samples[0],
    }


# ------------------------------------------------------------------------------------- checkpoint
def write_state(source: Source, directory: Path) -> None:
    """``pipeline.json`` in a checkpoint being written, when the source has batches to keep."""
    batches = source.state()
    if batches is not None:
        (directory / PIPELINE_FILE).write_text(json.dumps({"batches": batches}) + "\n")


def read_state(source: Source, directory: Path) -> None:
    """Restore the untrained batches of the checkpoint at ``directory`` (none without the file)."""
    path = directory / PIPELINE_FILE
    source.load_state(json.loads(path.read_text())["batches"] if path.exists() else [])


def _encode(rollout: Rollout) -> dict:
    prompts = rollout.prompts
    return {
        "step": rollout.step,
        "version": rollout.version,
        "prompts": {
            "examples": [asdict(ex) for ex in prompts.examples],
            "epoch": prompts.epoch,
            "position": prompts.position,
        },
        "output": asdict(rollout.output) | {"routed_experts": _encode_routes(rollout.output.routed_experts)},
    }


def _encode_routes(routes: list | None) -> list | None:
    """Each sample's engine routes as ``{dtype, shape, base64 of its bytes}`` (None stays None)."""
    if routes is None:
        return None
    return [
        None
        if r is None
        else {"dtype": str(r.dtype), "shape": list(r.shape), "data": base64.b64encode(r.tobytes()).decode()}
        for r in routes
    ]


def _decode_routes(routes: list | None) -> list | None:
    import numpy as np

    if routes is None:
        return None
    return [
        None
        if r is None
        else np.frombuffer(base64.b64decode(r["data"]), dtype=r["dtype"]).reshape(r["shape"]).copy()
        for r in routes
    ]


def _decode(raw: dict) -> Rollout:
    p = raw["prompts"]
    prompts = PromptBatch(
        [PromptExample(**ex) for ex in p["examples"]], epoch=p["epoch"], position=p["position"]
    )
    out = dict(raw["output"])
    if out.get("turn_rewards") is not None:
        out["turn_rewards"] = [[(int(pos), float(r)) for pos, r in row] for row in out["turn_rewards"]]
    out["routed_experts"] = _decode_routes(out.get("routed_experts"))
    return Rollout(raw["step"], prompts, RolloutOutput(**out), raw["version"])
