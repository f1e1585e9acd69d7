"""The single controller: one PPO step reads like the data flow in DESIGN.md.

    generate → reward (→ DAPO's further rounds, ReMax's greedy baselines) → old log-probs,
    reference log-probs, values → KL (in reward, or as a loss) → advantages → ppo_epochs ×
    mini-batches of critic and actor updates → weight sync → metrics → checkpoint and eval on schedule

With ``trainer.overlap_critic`` the critic's values and update run on its ranks while the actor
computes its log-probs and its update and sync, and are collected after them.

With ``reward.launch_reward_fn_async`` the reward is scored on a thread during the log-probs and
values, and joined before the advantages.

The rollout side of the step (the batch from the engines, rewards, the extra rollouts) is
:class:`~rltrain.trainer.rollout_side.RolloutSide`, mixed in; saving, resuming and loading the
run's checkpoints is :class:`~rltrain.trainer.run_state.CheckpointedRun`, mixed in too.

The driver holds no model: roles are handles whose methods run on their workers. Every random
choice is a function of (seed, step), so a run resumed from a checkpoint repeats the metrics of an
uninterrupted one: sampling uses seed ``rollout.seed + step``, mini-batch shuffling
``trainer.seed + step``; the data position and the KL controller are checkpointed. A resume takes
the newest checkpoint that verifies against its manifest and loads into every role, saying in one
line why it passed over any newer one (:mod:`rltrain.trainer.checkpoints`). A stop signal
(:mod:`~rltrain.trainer.preemption`) ends the loop after the step in progress, saved; a restart
after a lost worker (:mod:`~rltrain.trainer.recovery`) resumes a new trainer with ``start``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rltrain.algo import masked_mean
from rltrain.config import RLConfig
from rltrain.data.loader import PromptBatch
from rltrain.data.step_batch import StepBatch, step_uid_prefix
from rltrain.logging import metrics as mk
from rltrain.logging.metrics import length_metrics, throughput_metrics
from rltrain.logging.samples import SAMPLES_LOGGER
from rltrain.logging.timer import StageTimer
from rltrain.rollout.mismatch import logprob_mismatch
from rltrain.trainer.algorithms import build_algorithm
from rltrain.trainer.checkpoints import RunCheckpoints
from rltrain.trainer.dynamic_sampling import (
    ScoredRound,
)
from rltrain.trainer.pipeline import build_source
from rltrain.trainer.preemption import StopSignals
from rltrain.trainer.roles import CriticRole, PolicyRole, RewardModelRole
from rltrain.trainer.rollout_side import RolloutSide
from rltrain.trainer.run_state import CheckpointedRun
from rltrain.trainer.sample_records import dump_rollout, trace_advantages

if TYPE_CHECKING:
    from rltrain.rewards import RewardOutput
    from rltrain.trainer.run import RunData

log = logging.getLogger(__name__)


@dataclass
class Roles:
    policy: PolicyRole
    """Actor, reference and rollout."""

    critic: CriticRole | None = None
    """The critic, or None without one."""

    reward_model: RewardModelRole | None = None
    """The learned reward model (``reward.reward_model.enable``), or None."""


class Rewards(Protocol):
    """Scores decoded responses: a :class:`~rltrain.rewards.RewardManager`, or the Ray pool around one
    (:class:`~rltrain.orchestrator.reward_workers.RayRewardPool`)."""

    def __call__(
        self,
        responses: Sequence[str],
        *,
        ground_truths: Sequence[str],
        data_sources: Sequence[str],
        extra_infos: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardOutput: ...


class MetricsSink(Protocol):
    """Where a step's metrics go (:class:`~rltrain.logging.tracker.MetricsLogger`)."""

    def log(self, metrics: Mapping[str, float], *, step: int) -> None: ...


class Tokenizer(Protocol):
    """The part of an HF tokenizer the driver uses."""

    pad_token_id: int

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool) -> str: ...


class Progress(Protocol):
    """A progress display (:class:`~rltrain.logging.progress.StepProgress`)."""

    def update(self, metrics: Mapping[str, float] | None = None) -> None: ...


class PPOTrainer(RolloutSide, CheckpointedRun):
    def __init__(
        self,
        config: RLConfig,
        *,
        roles: Roles,
        tokenizer: Tokenizer,
        data: RunData,
        rewards: Rewards,
        tracker: MetricsSink,
        total_steps: int,
        checkpoints: RunCheckpoints | None = None,
        stop: StopSignals | None = None,
    ) -> None:
        """``stop``: the preemption signals (:mod:`~rltrain.trainer.preemption`); None ignores them."""
        self.config, self.roles, self.tokenizer = config, roles, tokenizer
        self.stop = stop
        self.data, self.rewards, self.tracker = data, rewards, tracker
        self.total_steps = total_steps
        self.algorithm = build_algorithm(config)
        """What the run's algorithm adds to the step (:mod:`rltrain.trainer.algorithms`)."""
        self.checkpoints = checkpoints or RunCheckpoints(
            config.run_dir() / "checkpoints", keep=config.trainer.checkpoint.max_ckpt_to_keep
        )
        self.timer = StageTimer()
        self._reward_thread: ThreadPoolExecutor | None = None
        # per-sample TRACE lines of this process (trainer.log_samples); set either way, never inherited
        logging.getLogger(SAMPLES_LOGGER).setLevel(
            logging.NOTSET if config.trainer.log_samples else logging.INFO
        )
        self.source = build_source(
            config,
            roles.policy,
            total_steps=total_steps,
            next_prompts=lambda: self.data.train.next_batch(),
            engine_prompts=lambda p: self.engine_prompts(p.prompt_ids, p.ground_truths, p.data_sources),
            sampling=self.sampling,
        )
        """Each step's rollout (``trainer.pipeline``: :mod:`rltrain.trainer.pipeline`)."""

    # ---------------------------------------------------------------------------------------- loop
    def fit(self, *, progress: Progress | None = None) -> int:
        """Train until ``total_steps``; returns the last step. Resumes first when configured."""
        return self.train_from(self.start(), progress=progress)

    def start(self, *, recovering: bool = False) -> int:
        """Resume (``recovering``: from the run's last good checkpoint whatever ``resume_mode`` says)
        and put the actor's weights into the engines; the step to continue after."""
        step = self.resume(recovering=recovering)
        self.source.start(step)
        if self.config.trainer.val_before_train and step == 0:
            self.tracker.log(self.validate(step=0), step=0)
        self.source.refill()
        return step

    def train_from(self, step: int, *, progress: Progress | None = None) -> int:
        """Steps after ``step`` until ``total_steps``, or until a stop signal (:attr:`stop`): then the
        step is saved, due or not, and the last step returned."""
        trainer = self.config.trainer
        if self._stop_requested():
            return step
        while step < self.total_steps:
            step += 1
            metrics = self.train_step(step)
            last = step == self.total_steps
            if _due(trainer.test_freq, step, last):
                metrics |= self.validate(step=step)
            self.tracker.log(metrics, step=step)
            if progress is not None:
                progress.update(metrics)
            saved = _due(trainer.save_freq, step, last)
            if saved:
                self.save(step)
            if not last and self._stop_requested():
                if not saved:
                    self.save(step)
                return step
            self.source.refill()
        return step

    def _stop_requested(self) -> bool:
        return self.stop is not None and self.stop.requested() is not None

    def train_step(self, step: int) -> dict[str, float]:
        """One step of the data flow in the module docstring; what an algorithm adds or changes is
        asked of :attr:`algorithm` (extra rollouts, reward shaping, advantages, the critic's warm-up)."""
        timer, critic = self.timer, self.roles.critic
        timer.reset()
        with timer.stage("step"):
            rollout, first, scoring, metrics = self.rollout_and_score(step)
            scored, more = self.algorithm.extra_rollouts(self, step, first)  # as generate and reward
            batch, prompts = scored.batch, scored.prompts
            metrics |= more
            entropy, joined = self.forward_passes(batch, scoring)
            metrics = {**joined, **metrics}
            with timer.stage("advantages"):
                metrics |= self.algorithm.advantages(batch)
                trace_advantages(batch)
            mini_batches = self.mini_batches(batch, step)
            critic_update = None
            if critic is not None:
                with timer.stage("update_critic"):
                    critic_update = critic.start_update(mini_batches, self.algorithm.critic_loss)
            actor_metrics = self.update_actor(step, mini_batches)
            if critic_update is not None:
                with timer.stage("update_critic"):
                    metrics |= _mean_over_steps(critic_update.result())
            metrics |= actor_metrics
        metrics |= self.step_metrics(batch, entropy=entropy, prompts=prompts)
        metrics |= self.source.metrics(rollout, step, step_seconds=timer.seconds["step"])
        if self.config.trainer.rollout_data_dir:
            dump_rollout(self.config.trainer.rollout_data_dir, step, batch, self.tokenizer)
        num_tokens = int(batch.attention_mask.sum())
        return (
            metrics
            | timer.metrics()
            | throughput_metrics(num_tokens=num_tokens, step_seconds=timer.seconds["step"])
        )

    # ------------------------------------------------------------------------------------- stages
    def rollout_and_score(self, step: int):
        """The step's rollout (from :attr:`source`), its batch and its scores: the rollout, the
        scored round, the scoring's future (``reward.launch_reward_fn_async``: joined in
        :meth:`forward_passes`, the round's ``correct`` then None) or None, and the reward metrics."""
        with self.timer.stage("generate"):  # asynchronous pipelines: the wait for the batch
            rollout = self.source.take(step)
            prompts = rollout.prompts
            batch = self.step_batch(
                rollout.output, prompts, self.sampling(step), uid_prefix=step_uid_prefix(step)
            )
        with self.timer.stage("reward"):
            if self.config.reward.launch_reward_fn_async:
                return (
                    rollout,
                    ScoredRound(prompts, batch, None),
                    self.reward_thread().submit(self.score, batch),
                    {},
                )
            metrics, correct = self.score(batch)
        return rollout, ScoredRound(prompts, batch, correct), None, metrics

    def forward_passes(
        self, batch: StepBatch, scoring: Future | None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Old log-probs (and the engine's routes to replay), reference log-probs when the algorithm
        needs them, values (the critic computes while the actor does), the joined scoring; the
        entropy and the joined scoring's metrics."""
        timer, policy, critic = self.timer, self.roles.policy, self.roles.critic
        values = None
        if critic is not None:
            with timer.stage("values"):
                values = critic.start_values(batch)
        with timer.stage("old_logprob"):
            batch.old_logprobs, entropy, routes = policy.compute_log_prob(batch)
            if routes is not None:  # router_replay R2: the reference and update passes replay them
                batch.routed_experts = routes
        if self.algorithm.needs.reference:
            with timer.stage("ref"):
                batch.ref_logprobs = policy.compute_ref_log_prob(batch)
        if values is not None:
            with timer.stage("values"):
                batch.values = values.result()
        if scoring is None:
            return entropy, {}
        with timer.stage("reward"):
            return entropy, scoring.result()[0]

    def update_actor(self, step: int, mini_batches: list[StepBatch]) -> dict[str, float]:
        """The actor's update and the weight sync after it, unless the algorithm skips the update."""
        if not self.algorithm.updates_actor(step):
            self.source.after_update(step, updated=False)
            return {}
        with self.timer.stage("update_actor"):
            metrics = _mean_over_steps(self.roles.policy.update(mini_batches, self.algorithm.actor_loss))
        with self.timer.stage("weight_sync"):
            return metrics | self.source.after_update(step, updated=True)

    def reward_thread(self) -> ThreadPoolExecutor:
        """The one thread that scores steps with ``reward.launch_reward_fn_async`` (started on first use)."""
        if self._reward_thread is None:
            self._reward_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rltrain-reward")
        return self._reward_thread

    @property
    def kl_ctrl(self):
        """The algorithm's KL controller (β of the KL in the reward), checkpointed with the run."""
        return self.algorithm.kl_ctrl

    def mini_batches(self, batch: StepBatch, step: int) -> list[StepBatch]:
        """``ppo_epochs`` shuffled passes of ``ppo_mini_batch_size × n`` samples each."""
        actor = self.config.actor
        size = actor.ppo_mini_batch_size * self.config.rollout.n
        out = []
        for epoch in range(actor.ppo_epochs):
            order = torch.arange(batch.batch_size)
            if actor.shuffle:
                order = torch.randperm(
                    batch.batch_size,
                    generator=torch.Generator().manual_seed(
                        self.config.trainer.seed * 100_003 + step * 101 + epoch
                    ),
                )
            out += [batch.select(order[i : i + size]) for i in range(0, batch.batch_size, size)]
        return out

    def step_metrics(
        self, batch: StepBatch, *, entropy: torch.Tensor, prompts: PromptBatch
    ) -> dict[str, float]:
        mask = batch.response_mask
        # every response token (a multi-turn response's tool tokens too: they fill its budget)
        response_lengths = batch.attention_mask[:, -batch.response_len :].sum(-1).tolist()
        prompt_lengths = [len(p) for p in prompts.prompt_ids]
        metrics = length_metrics(prompt_lengths, response_lengths, max_response_length=batch.response_len)
        metrics |= logprob_mismatch(
            batch.old_logprobs, batch.rollout_logprobs, mask, tis_cap=self.config.actor.tis_imp_ratio_cap
        )
        metrics[mk.ACTOR_ENTROPY_BEFORE_UPDATE] = float(masked_mean(entropy, mask.float()))
        metrics[mk.DATA_EPOCH] = float(prompts.epoch)
        return metrics | batch.extra_metrics

    # ---------------------------------------------------------------------------------- eval/ckpt


def _due(freq: int, step: int, last: bool) -> bool:
    return freq != 0 and ((freq > 0 and step % freq == 0) or last)


def _mean_over_steps(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Average each metric over the optimizer steps of the update (skip counts add up)."""
    keys = per_step[0].keys()
    return {
        k: sum(m[k] for m in per_step) / (1 if k.endswith(mk.SKIPPED_STEPS) else len(per_step)) for k in keys
    }
