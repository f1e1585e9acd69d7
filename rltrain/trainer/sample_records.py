"""What a step batch says about each of its samples: the trace lines and the dump rows of
:mod:`rltrain.logging.samples`, from :class:`~rltrain.data.step_batch.StepBatch` fields.

Per sample (``[batch]``):

* ``response_length``: every response token (a multi-turn response's tool tokens too, as the
  ``response_length/*`` metrics count);
* ``score``: ``StepBatch.scores``, the reward function's score after any shaping (reward model,
  overlong penalty);
* ``reward``: the sum of the token-level rewards over the sampled response tokens (the score, minus
  β·KL with ``algorithm.use_kl_in_reward``, plus an interaction's turn rewards): what the advantage
  estimator saw;
* ``advantage``: the mean advantage over the sampled response tokens (0 for a response without any).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from rltrain.data.step_batch import StepBatch
from rltrain.logging.samples import log_advantages, log_rewards, log_rollout, write_samples

if TYPE_CHECKING:
    from rltrain.data.prompt_rows import PromptExample
    from rltrain.rewards import RewardOutput
    from rltrain.rollout.types import RolloutOutput


class Decoder(Protocol):
    def decode(self, token_ids: list[int], *, skip_special_tokens: bool) -> str: ...


def response_lengths(batch: StepBatch) -> list[int]:
    return batch.attention_mask[:, -batch.response_len :].sum(-1).tolist()


def trace_rollout(batch: StepBatch) -> None:
    log_rollout(batch.uids, batch.finish_reasons, response_lengths(batch))


def trace_rewards(batch: StepBatch, correct: torch.Tensor) -> None:
    log_rewards(batch.uids, batch.scores.tolist(), correct.tolist())


def advantage_means(batch: StepBatch) -> list[float]:
    mask = batch.response_mask.float()
    return ((batch.advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).tolist()


def sample_rewards(batch: StepBatch) -> list[float]:
    return (batch.token_level_rewards * batch.response_mask.float()).sum(-1).tolist()


def trace_advantages(batch: StepBatch) -> None:
    tokens = batch.response_mask.sum(-1).tolist()
    log_advantages(batch.uids, advantage_means(batch), sample_rewards(batch), tokens)


def dump_rollout(directory: str | Path, step: int, batch: StepBatch, tokenizer: Decoder) -> Path:
    """``<directory>/<step>.jsonl``: a row per sample of the step's batch (advantages computed)."""
    prompt_len = batch.input_ids.size(1) - batch.response_len
    prompts = _decode_rows(tokenizer, batch.input_ids[:, :prompt_len], batch.attention_mask[:, :prompt_len])
    responses = _decode_rows(tokenizer, batch.response_ids, batch.response_mask)
    scores, rewards, advantages = batch.scores.tolist(), sample_rewards(batch), advantage_means(batch)
    lengths = response_lengths(batch)
    rows = [
        {
            "uid": batch.uids[i],
            "step": step,
            "input": prompts[i],
            "output": responses[i],
            "gts": batch.ground_truths[i],
            "data_source": batch.data_sources[i],
            "score": scores[i],
            "reward": rewards[i],
            "advantage": advantages[i],
            "response_length": lengths[i],
            "finish_reason": batch.finish_reasons[i],
        }
        for i in range(batch.batch_size)
    ]
    return write_samples(directory, step, rows)


def dump_validation(
    directory: str | Path,
    step: int,
    *,
    uids: Sequence[str],
    examples: Sequence[PromptExample],
    output: RolloutOutput,
    responses: Sequence[str],
    result: RewardOutput,
    tokenizer: Decoder,
) -> Path:
    """``<directory>/<step>.jsonl``: a row per validation sample (``output.n`` per example, in order;
    ``responses`` decoded, ``result`` their rewards)."""
    n = output.n
    prompts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in output.prompt_ids]
    scores, correct = result.scores.tolist(), result.correct.tolist()
    rows = [
        {
            "uid": uids[i],
            "step": step,
            "input": prompts[i // n],
            "output": responses[i],
            "gts": examples[i // n].ground_truth,
            "data_source": examples[i // n].data_source,
            "score": scores[i],
            "acc": bool(correct[i]),
            "response_length": len(output.response_ids[i]),
            "finish_reason": output.finish_reasons[i],
        }
        for i in range(output.num_samples)
    ]
    return write_samples(directory, step, rows)


def _decode_rows(tokenizer: Decoder, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    keep = mask.bool()
    return [tokenizer.decode(row[m].tolist(), skip_special_tokens=True) for row, m in zip(ids, keep)]
