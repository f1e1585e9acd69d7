"""Role handles: the verbs the driver calls, with data-parallel dispatch and gathering.

A handle turns one driver-side call into per-rank calls: a :class:`StepBatch` is cut into as many
contiguous parts as the role has data-parallel ranks, every rank of a data-parallel group gets the
same part, and the result of each group's first rank is kept (Megatron hands every rank of a
TP/PP group the same output). The backend is anything with ``call``/``call_each`` and ``world_size``
(a Ray worker group, or the in-process group of the torchrun mode). Every update goes through the
role's :class:`~rltrain.trainer.divergence.DivergenceGuard` (``trainer`` settings) before it
returns, so a role that diverged stops the run there, before the step's checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import torch

from rltrain.algo.loss_agg import GlobalCounts
from rltrain.algo.loss_specs import ActorLoss, CriticLoss
from rltrain.config.trainer import TrainerConfig
from rltrain.data.step_batch import StepBatch
from rltrain.orchestrator.placement import RolloutPlacement
from rltrain.rollout.types import RolloutOutput, SamplingConfig
from rltrain.trainer.divergence import DivergenceGuard


class Group(Protocol):
    role: str
    world_size: int

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]: ...

    def call_each(self, method: str, per_rank_args: list[tuple], **kwargs: Any) -> list[Any]: ...


class EngineGroup(Group, Protocol):
    """A group that also starts a call without waiting (the separate engines receive weights while
    the actor sends them): ``wait(method, submit(method, ...))`` is ``call(method, ...)``."""

    def submit(self, method: str, *args: Any, **kwargs: Any) -> list: ...

    def submit_each(self, method: str, per_rank_args: list[tuple], **kwargs: Any) -> list: ...

    def wait(self, method: str, refs: list) -> list[Any]: ...

    def ready(self, refs: list) -> bool: ...


T = TypeVar("T")


class PendingCall(Generic[T]):
    """A role's call that the driver collects later: :meth:`result` returns its value (waiting for
    it, within the method's ``trainer.timeouts`` bound, where it still runs)."""

    def __init__(self, finish: Callable[[], T]) -> None:
        self._finish = finish

    def result(self) -> T:
        return self._finish()


class _DataParallelRole:
    metric_prefix = ""
    """The prefix of the role's update metrics (``actor``, ``critic``)."""

    def __init__(self, group: Group, *, trainer: TrainerConfig | None = None, overlap: bool = False) -> None:
        """``trainer``: the run's divergence limits (``trainer.max_consecutive_skipped_steps``,
        ``trainer.max_param_abs``); their defaults if None. ``overlap``: the ``start_*`` methods
        return once their call has started on the ranks (the group must be an :class:`EngineGroup`,
        e.g. Ray's), so that it runs while the driver calls other roles; else once it has finished."""
        self.group = group
        self.overlap = overlap
        self.guard = DivergenceGuard.from_config(self.metric_prefix, trainer or TrainerConfig())
        infos = group.call("rank_info")
        self.dp_ranks = [info["dp_rank"] for info in infos]
        self.dp_size = infos[0]["dp_size"]
        self.leaders = [self.dp_ranks.index(d) for d in range(self.dp_size)]

    def _dispatch(self, method: str, batch: StepBatch) -> list[Any]:
        return self._start_dispatch(method, batch).result()

    def _start_each(self, method: str, per_rank_args: list[tuple]) -> PendingCall[list[Any]]:
        """``group.call_each(method, per_rank_args)``: started on the ranks with :attr:`overlap`, else
        run to the end before this returns."""
        if not self.overlap:
            results = self.group.call_each(method, per_rank_args)
            return PendingCall(lambda: results)
        refs = self.group.submit_each(method, per_rank_args)
        return PendingCall(lambda: self.group.wait(method, refs))

    def _start_dispatch(self, method: str, batch: StepBatch) -> PendingCall[list[Any]]:
        """``batch`` cut into contiguous data-parallel parts (as it is now), ``method`` on each rank
        with its group's part; the result keeps each data-parallel group's first rank's answer."""
        parts = batch.chunk(self.dp_size)
        pending = self._start_each(method, [(parts[d],) for d in self.dp_ranks])

        def leaders_answers() -> list[Any]:
            results = pending.result()
            return [results[rank] for rank in self.leaders]

        return PendingCall(leaders_answers)

    def _update(self, method: str, mini_batches: list[StepBatch], loss: Any) -> list[dict[str, float]]:
        return self._start_update(method, mini_batches, loss).result()

    def _start_update(
        self, method: str, mini_batches: list[StepBatch], loss: Any
    ) -> PendingCall[list[dict[str, float]]]:
        """One optimizer step of ``loss`` (the algorithm's, :mod:`rltrain.algo.loss_specs`) per
        mini-batch; each rank gets its data-parallel part of every one. Its result has passed the
        role's divergence guard."""
        plans: list[list[tuple[StepBatch, GlobalCounts]]] = [[] for _ in range(self.dp_size)]
        for mini in mini_batches:
            counts = GlobalCounts.of(mini.response_mask)
            for d, part in enumerate(mini.chunk(self.dp_size)):
                plans[d].append((part, counts))
        pending = self._start_each(method, [(plans[d], loss) for d in self.dp_ranks])

        def checked() -> list[dict[str, float]]:
            results = pending.result()
            self.guard.check(results[0])  # metrics are already reduced over ranks
            return results[0]

        return PendingCall(checked)

    def save(self, root: str, step: int) -> None:
        self.group.call("save_checkpoint", root, step)

    def load(self, root: str) -> int | None:
        steps = set(self.group.call("load_checkpoint", root))
        if len(steps) != 1:
            raise RuntimeError(f"{self.group.role}: ranks loaded different checkpoint steps {sorted(steps)}")
        return steps.pop()


class PolicyRole(_DataParallelRole):
    """Actor + reference, and the rollout engines: colocated on the actor's ranks
    (``placement.engine_ranks``), or a separate engine group (``separate``, weights broadcast from
    actor rank 0)."""

    metric_prefix = "actor"

    def __init__(
        self,
        group: Group,
        *,
        placement: RolloutPlacement,
        separate: EngineGroup | None = None,
        trainer: TrainerConfig | None = None,
    ) -> None:
        if placement.separate != (separate is not None):
            raise ValueError(
                f"rollout.mode={placement.mode} needs "
                + ("a separate engine group" if placement.separate else "no separate engine group")
            )
        super().__init__(group, trainer=trainer)
        self.placement = placement
        self.separate = separate

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutOutput:
        """n samples per prompt; prompts are split contiguously over the engines, outputs merged."""
        group = self.separate or self.group
        engines = (
            list(range(self.separate.world_size)) if self.separate else list(self.placement.engine_ranks)
        )
        answers = group.call_each("generate", _engine_args(prompts, sampling, engines, group))
        outputs = [o for o in answers if o is not None]
        return RolloutOutput.concat(outputs, n=sampling.n)

    def start_generate(self, prompts: list, sampling: SamplingConfig) -> PendingRollout:
        """:meth:`generate` on the separate engines without waiting (``trainer.pipeline``)."""
        if self.separate is None:
            raise ValueError("generating while the actor trains needs rollout.mode=separate")
        engines = list(range(self.separate.world_size))
        refs = self.separate.submit_each(
            "generate_timed", _engine_args(prompts, sampling, engines, self.separate)
        )
        return PendingRollout(self.separate, refs, n=sampling.n)

    def queue_generate(self, prompts: list, sampling: SamplingConfig) -> QueuedRollout:
        """:meth:`start_generate` for partial rollouts (``rollout.partial_rollout``): the batch is
        queued on the engines, which stay free to receive weights while it generates."""
        if self.separate is None:
            raise ValueError("generating while the actor trains needs rollout.mode=separate")
        engines = list(range(self.separate.world_size))
        keys = self.separate.call_each("queue_batch", _engine_args(prompts, sampling, engines, self.separate))
        return QueuedRollout(self.separate, keys, n=sampling.n)

    def compute_log_prob(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(old log-probs, entropy, the actor's recorded routes or None: ``router_replay.mode=R2``)."""
        parts = self._dispatch("compute_log_prob", batch)
        routes = None if parts[0][2] is None else torch.cat([p[2] for p in parts])
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), routes

    def compute_ref_log_prob(self, batch: StepBatch) -> torch.Tensor:
        return torch.cat(self._dispatch("compute_ref_log_prob", batch))

    def update(self, mini_batches: list[StepBatch], loss: ActorLoss) -> list[dict[str, float]]:
        return self._update("update_actor", mini_batches, loss)

    def sync_weights(self, step: int, *, version: int | None = None) -> dict[str, float]:
        """Send the actor's weights after ``step`` to the engines (the step numbers the sync for the
        sampled verification); ``version`` (partial rollouts): the policy version they are, given to
        separate engines that may have batches in flight."""
        receiving = self.separate.submit("receive_weights", step, version) if self.separate else None
        metrics: dict[str, float] = {}
        for rank_metrics in self.group.call("sync_weights", step):
            for key, value in rank_metrics.items():
                metrics[key] = max(metrics.get(key, value), value)
        if receiving is not None:
            for rank_metrics in self.separate.wait("receive_weights", receiving):
                for key, value in rank_metrics.items():
                    metrics[key] = max(metrics.get(key, value), value)
        return metrics


class CriticRole(_DataParallelRole):
    """The critic; with ``overlap`` (``trainer.overlap_critic``) its ``start_*`` calls run on its
    ranks while the driver calls the actor."""

    metric_prefix = "critic"

    def start_values(self, batch: StepBatch) -> PendingCall[torch.Tensor]:
        """``[batch, response_len]`` values of ``batch``'s responses, collected by ``result()``."""
        parts = self._start_dispatch("compute_values", batch)
        return PendingCall(lambda: torch.cat(parts.result()))

    def update(self, mini_batches: list[StepBatch], loss: CriticLoss) -> list[dict[str, float]]:
        return self._update("update_critic", mini_batches, loss)

    def start_update(
        self, mini_batches: list[StepBatch], loss: CriticLoss
    ) -> PendingCall[list[dict[str, float]]]:
        """One optimizer step per mini-batch; ``result()`` gives each step's metrics."""
        return self._start_update("update_critic", mini_batches, loss)


class RewardModelRole(_DataParallelRole):
    """The learned reward model (``reward.reward_model``): forward only, on its own pool's ranks."""

    metric_prefix = "reward_model"

    def compute_rm_score(self, batch: StepBatch) -> torch.Tensor:
        """``[batch]`` float32: the model's score of each sample at its last token."""
        return torch.cat(self._dispatch("compute_rm_score", batch))


class PendingRollout:
    """A rollout running on the separate engines: :meth:`done` polls, :meth:`result` waits
    (``trainer.timeouts.generate_s``, naming the engines that did not answer)."""

    def __init__(self, group: EngineGroup, refs: list, *, n: int) -> None:
        self.group, self.refs, self.n = group, refs, n

    def done(self) -> bool:
        return self.group.ready(self.refs)

    def result(self) -> tuple[RolloutOutput, float]:
        """The merged output and the longest time an engine spent generating it."""
        answers = [a for a in self.group.wait("generate_timed", self.refs) if a[0] is not None]
        seconds = max((a[1] for a in answers), default=0.0)
        return RolloutOutput.concat([a[0] for a in answers], n=self.n), seconds


class QueuedRollout:
    """A batch queued on the separate engines (:meth:`PolicyRole.queue_generate`): :meth:`result`
    collects it (``trainer.timeouts.generate_s``, naming the engines that did not answer)."""

    def __init__(self, group: EngineGroup, keys: list, *, n: int) -> None:
        self.group, self.keys, self.n = group, keys, n

    def result(self) -> tuple[RolloutOutput, float]:
        """The merged output (with ``token_versions``) and the longest time an engine generated it."""
        refs = self.group.submit_each("batch_result", [(k,) for k in self.keys])
        answers = [a for a in self.group.wait("batch_result", refs) if a[0] is not None]
        seconds = max((a[1] for a in answers), default=0.0)
        return RolloutOutput.concat([a[0] for a in answers], n=self.n), seconds


def _engine_args(prompts: list, sampling: SamplingConfig, engines: list[int], group: Group) -> list[tuple]:
    """Per-rank ``(prompts, sampling)``: contiguous shares on ``engines``, none on the other ranks."""
    args = [((), sampling)] * group.world_size
    for share, rank in zip(_split_even(prompts, len(engines)), engines):
        args[rank] = (share, sampling)
    return args


def _split_even(items: list, parts: int) -> list[list]:
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out
