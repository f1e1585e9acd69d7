"""The rollout side of a step, mixed into :class:`~rltrain.trainer.driver.PPOTrainer`: sampling
settings, the step batch from the engines' output, decoding and rewards (with DAPO's overlong
shaping), validation on the held-out prompts (:meth:`RolloutSide.validate`), and the rollouts a step
may add to its own (:meth:`RolloutSide.generate_and_score`: the algorithm's extra rollouts, such as
dynamic sampling's further rounds and ReMax's greedy baselines, :mod:`rltrain.trainer.algorithms`),
timed as the step's generate and reward stages. Each rollout's samples get ids of their own (``step3``, ``step3-r1``, ``step3-greedy``:
:func:`~rltrain.data.step_batch.step_uid_prefix`), named in the run log's rollout and reward lines
(:mod:`rltrain.logging.samples`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rltrain.agent.loop import AgentPrompt
from rltrain.agent.trajectory import step_metrics as agent_step_metrics
from rltrain.data.step_batch import StepBatch, build_step_batch, sample_uids, step_uid_prefix
from rltrain.logging import metrics as mk
from rltrain.logging.metrics import REWARD_MODEL_SCORE, REWARD_TOTAL, summary_stats
from rltrain.rollout.types import SamplingConfig
from rltrain.trainer.dynamic_sampling import (
    OVERLONG_FRAC,
    OVERLONG_PENALTY_MEAN,
    ScoredRound,
    overlong_penalty,
)
from rltrain.trainer.sample_records import dump_validation, trace_rewards, trace_rollout

if TYPE_CHECKING:
    from rltrain.config import RLConfig
    from rltrain.data.loader import PromptBatch
    from rltrain.logging.timer import StageTimer
    from rltrain.rollout.types import RolloutOutput
    from rltrain.trainer.driver import Rewards, Roles, Tokenizer
    from rltrain.trainer.run import RunData


class RolloutSide:
    """What the trainer does between the engines and the rewards; reads the trainer's attributes."""

    config: RLConfig
    roles: Roles
    tokenizer: Tokenizer
    rewards: Rewards
    data: RunData
    timer: StageTimer

    def sampling(self, step: int) -> SamplingConfig:
        """The sampling settings of ``step``'s rollout (seed ``rollout.seed + step``)."""
        return SamplingConfig.from_rollout_config(self.config.rollout, seed=self.config.rollout.seed + step)

    def step_batch(
        self, output: RolloutOutput, prompts: PromptBatch, sampling: SamplingConfig, *, uid_prefix: str
    ) -> StepBatch:
        """The step's batch from the engines' ``output`` for ``prompts``, its samples' ids starting
        ``uid_prefix``; one rollout line per sample in the run log."""
        batch = build_step_batch(
            prompt_ids=output.prompt_ids,
            response_ids=output.response_ids,
            response_logprobs=output.response_logprobs,
            finish_reasons=output.finish_reasons,
            n=sampling.n,
            data_sources=prompts.data_sources,
            ground_truths=prompts.ground_truths,
            pad_token_id=self.tokenizer.pad_token_id,
            response_length=sampling.response_length,
            sampled_masks=output.sampled_masks,
            turn_rewards=output.turn_rewards,
            uid_prefix=uid_prefix,
            extra_infos=[ex.extra_info for ex in prompts.examples],
            routed_experts=self.engine_routes(output),
        )
        if output.sample_metrics is not None:
            batch.extra_metrics |= agent_step_metrics(output.sample_metrics)
        trace_rollout(batch)
        return batch

    def engine_routes(self, output: RolloutOutput) -> list | None:
        """The engine's routes of each sample under ``actor.router_replay.mode=R3`` (None entries
        where it returned none: the batch builder names them), else None."""
        if self.config.actor.router_replay.mode != "R3":
            return None
        return output.routed_experts or [None] * output.num_samples

    def engine_prompts(self, prompt_ids: list[list[int]], ground_truths: list[str], data_sources: list[str]):
        """What the engines are handed: token ids, or with ``rollout.multi_turn.enable`` the
        :class:`~rltrain.agent.loop.AgentPrompt` of each row (its interaction needs the answer)."""
        if not self.config.rollout.multi_turn.enable:
            return prompt_ids
        return [AgentPrompt(ids, gt, ds) for ids, gt, ds in zip(prompt_ids, ground_truths, data_sources)]

    def score(self, batch: StepBatch) -> tuple[dict[str, float], torch.Tensor]:
        """Set ``batch.scores`` (with overlong shaping when on); the reward metrics and ``[batch]``
        whether each answer was correct. One reward line per sample in the run log."""
        texts = self.decode(batch)
        result = self.rewards(
            texts,
            ground_truths=batch.ground_truths,
            data_sources=batch.data_sources,
            extra_infos=batch.extra_infos,
        )
        batch.scores = result.scores.float()
        metrics = dict(result.metrics)
        if self.roles.reward_model is not None:
            rm = self.config.reward.reward_model
            model_scores = self.model_scores(batch)
            metrics |= summary_stats(REWARD_MODEL_SCORE, model_scores.tolist())
            batch.scores = rm.score_weight * model_scores + rm.rule_weight * batch.scores
            metrics |= summary_stats(REWARD_TOTAL, batch.scores.tolist())
        overlong = self.config.reward.overlong_buffer
        if overlong.enable:
            penalty = overlong_penalty(
                batch.attention_mask[:, -batch.response_len :].sum(-1),
                response_length=batch.response_len,
                buffer_len=overlong.len,
                penalty_factor=overlong.penalty_factor,
            )
            batch.scores = batch.scores + penalty
            if overlong.log:
                metrics[OVERLONG_FRAC] = float((penalty < 0).float().mean())
                metrics[OVERLONG_PENALTY_MEAN] = float(penalty.mean())
        trace_rewards(batch, result.correct)
        return metrics, result.correct

    def model_scores(self, batch: StepBatch) -> torch.Tensor:
        """``[batch]`` the reward model's score of each sample. A batch that does not split over the
        reward model's data-parallel ranks (validation's, any size) is padded with copies of its last
        row for the call and the copies' scores dropped."""
        role = self.roles.reward_model
        assert role is not None
        rows = batch.batch_size
        padded = -rows % role.dp_size
        if padded:
            batch = batch.select(list(range(rows)) + [rows - 1] * padded)
        return role.compute_rm_score(batch)[:rows]

    def next_prompts(self) -> PromptBatch:
        """The data loader's next batch of prompts (a further round of the step's rollout)."""
        return self.data.train.next_batch()

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    def generate_and_score(
        self, prompts: PromptBatch, sampling: SamplingConfig, *, uid_prefix: str
    ) -> ScoredRound:
        """A rollout of ``prompts`` outside the step's own (timed as its generate and reward), its
        samples' ids starting ``uid_prefix``."""
        with self.timer.stage("generate"):
            output = self.roles.policy.generate(
                self.engine_prompts(prompts.prompt_ids, prompts.ground_truths, prompts.data_sources), sampling
            )
            batch = self.step_batch(output, prompts, sampling, uid_prefix=uid_prefix)
        with self.timer.stage("reward"):
            _, correct = self.score(batch)
        return ScoredRound(prompts, batch, correct)

    def decode(self, batch: StepBatch) -> list[str]:
        ids, mask = batch.response_ids, batch.response_mask.bool()
        return [self.tokenizer.decode(row[m].tolist(), skip_special_tokens=True) for row, m in zip(ids, mask)]

    def validate(self, *, step: int) -> dict[str, float]:
        """Greedy (``rollout.val_kwargs``) accuracy on the held-out prompts, after ``step``; with
        ``reward.reward_model`` also the model's mean score of the samples and the weighted total;
        with ``trainer.validation_data_dir`` its samples go to ``<dir>/<step>.jsonl``."""
        if self.data.val is None:
            return {}
        self.source.ensure_current()
        val, cfg = self.data.val, self.config.rollout
        sampling = SamplingConfig(
            temperature=cfg.val_kwargs.temperature,
            top_p=cfg.val_kwargs.top_p,
            n=cfg.val_kwargs.n,
            response_length=cfg.response_length,
            seed=cfg.seed,
        )
        output = self.roles.policy.generate(
            self.engine_prompts(
                [ex.prompt_ids for ex in val], [ex.ground_truth for ex in val], [ex.data_source for ex in val]
            ),
            sampling,
        )
        masks = output.sampled_masks or [[1] * len(ids) for ids in output.response_ids]
        texts = [
            self.tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
            for ids, mask in zip(output.response_ids, masks)
        ]
        n = sampling.n
        result = self.rewards(
            texts,
            ground_truths=[ex.ground_truth for ex in val for _ in range(n)],
            extra_infos=[ex.extra_info for ex in val for _ in range(n)],
            data_sources=[ex.data_source for ex in val for _ in range(n)],
        )
        if self.config.trainer.validation_data_dir:
            uids = sample_uids(step_uid_prefix(step, "val"), len(val), n)
            dump_validation(
                self.config.trainer.validation_data_dir,
                step,
                uids=uids,
                examples=val,
                output=output,
                responses=texts,
                result=result,
                tokenizer=self.tokenizer,
            )
        metrics = {
            mk.VAL_ACCURACY: float(result.correct.float().mean()),
            mk.VAL_SCORE_MEAN: float(result.scores.mean()),
        }
        if self.roles.reward_model is not None:  # as in training: the model scores the same tokens
            rm = self.config.reward.reward_model
            batch = build_step_batch(
                prompt_ids=output.prompt_ids,
                response_ids=output.response_ids,
                response_logprobs=output.response_logprobs,
                finish_reasons=output.finish_reasons,
                n=n,
                data_sources=[ex.data_source for ex in val],
                ground_truths=[ex.ground_truth for ex in val],
                pad_token_id=self.tokenizer.pad_token_id,
                response_length=sampling.response_length,
                sampled_masks=output.sampled_masks,
            )
            model_scores = self.model_scores(batch)
            metrics[mk.VAL_MODEL_SCORE_MEAN] = float(model_scores.mean())
            total = rm.score_weight * model_scores + rm.rule_weight * result.scores.float()
            metrics[mk.VAL_TOTAL_MEAN] = float(total.mean())
        return metrics
