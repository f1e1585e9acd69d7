"""DAPO's reward-side pieces between the rollout and the rest of a step (Yu et al. 2025,
https://arxiv.org/abs/2503.14476): dynamic sampling (verl's ``algorithm.filter_groups``) and overlong
reward shaping (``reward.overlong_buffer``).

Dynamic sampling. A group is the ``rollout.n`` samples of one prompt. When the filter ``metric`` is
the same for every sample of a group (all correct, all wrong), the group estimators give it zero
advantage and it only dilutes the batch. :func:`fill_batch` drops such groups (a group of one
sample is kept, as in verl), draws and generates another ``data.gen_batch_size`` prompts while fewer
than ``data.train_batch_size`` groups are kept, and trims the kept groups to exactly that many, in
generation order. ``max_num_gen_batches`` bounds the rounds (the first included; 0: no bound); a
step that reaches it without a full batch stops the run with an error naming the key (verl). Round
r > 0 samples with seed ``rollout.seed + step + r * ROUND_SEED_STRIDE``, so a run is deterministic
and its resume repeats it (the extra prompts advance the checkpointed data position). A kept
sample keeps the id of its round (``step3-r1-p0-s1``: round 1's prompt 0; ``StepBatch.uids``), so the
ids of the merged batch stay unique and name where each sample came from.

Metrics (``dynamic_sampling/*``): rounds, prompts generated, groups kept / dropped, kept groups
trimmed off, and the mean score of the trained samples. The ``reward/*`` metrics describe the first
round, an unbiased draw of the data like a step without filtering, so curves stay comparable.

Overlong shaping. With a response budget ``L_max`` (``rollout.response_length``) and buffer ``L_b``, a
response of ``l`` tokens (every response token: a multi-turn response's tool tokens fill the budget
too) gets ``min(0, -(l - (L_max - L_b)) / L_b · penalty_factor)`` added to its score.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rltrain.config.algorithm import FilterGroupsConfig
from rltrain.data.loader import PromptBatch
from rltrain.data.step_batch import StepBatch
from rltrain.errors import RunStopped

ROUND_SEED_STRIDE = 1_000_003
"""Seed offset between the generation rounds of one step (far above any step count)."""

NUM_GEN_BATCHES = "dynamic_sampling/num_gen_batches"
GENERATED_PROMPTS = "dynamic_sampling/generated_prompts"
KEPT_GROUPS = "dynamic_sampling/kept_groups"
DROPPED_GROUPS = "dynamic_sampling/dropped_groups"
SURPLUS_GROUPS = "dynamic_sampling/surplus_groups"
KEPT_SCORE_MEAN = "dynamic_sampling/kept_score_mean"
OVERLONG_FRAC = "reward/overlong_frac"
OVERLONG_PENALTY_MEAN = "reward/overlong_penalty_mean"


class DynamicSamplingExhausted(RunStopped):
    """A step used ``algorithm.filter_groups.max_num_gen_batches`` rounds without a full batch."""


@dataclass
class ScoredRound:
    """One generation round: its prompts and their scored samples (``rollout.n`` per prompt)."""

    prompts: PromptBatch
    batch: StepBatch
    """``scores`` set; ``group_ids`` 0..prompts-1 in prompt order."""

    correct: torch.Tensor | None
    """``[batch]`` bool: the answer matched (the ``acc`` metric); None while the scoring runs on
    (``reward.launch_reward_fn_async``) and after filtering."""


def group_values(round_: ScoredRound, metric: str) -> torch.Tensor:
    """``[batch]`` float: what must vary within a group under ``metric``."""
    batch = round_.batch
    if metric == "acc":
        return round_.correct.float()
    if metric == "score":
        return batch.scores.float()
    if metric in ("seq_reward", "seq_final_reward"):
        turns = 0.0 if batch.turn_rewards is None else (batch.turn_rewards * batch.response_mask).sum(-1)
        return batch.scores.float() + turns
    raise ValueError(f"unknown algorithm.filter_groups.metric {metric!r}")


def varying_groups(values: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``[num_groups]`` bool: the groups whose values are not all equal, or that hold one sample.

    ``values`` and ``group_ids`` are ``[batch]``; ids run over 0..num_groups-1."""
    ids = group_ids.long()
    high = torch.full((num_groups,), -torch.inf, dtype=values.dtype).scatter_reduce(0, ids, values, "amax")
    low = torch.full((num_groups,), torch.inf, dtype=values.dtype).scatter_reduce(0, ids, values, "amin")
    sizes = torch.bincount(ids, minlength=num_groups)
    return (high > low) | (sizes == 1)


def fill_batch(
    first: ScoredRound,
    more: Callable[[int], ScoredRound],
    *,
    config: FilterGroupsConfig,
    train_batch_size: int,
    n: int,
    pad_token_id: int,
    step: int,
) -> tuple[StepBatch, PromptBatch, dict[str, float]]:
    """The step's batch of exactly ``train_batch_size`` groups whose ``config.metric`` varies.

    ``more(r)`` generates and scores round ``r`` (1, 2, ...). Returns the batch (group ids
    renumbered 0..train_batch_size-1, prompts left-padded to one width), its prompts and the
    ``dynamic_sampling/*`` metrics. Raises :class:`DynamicSamplingExhausted` when
    ``max_num_gen_batches`` rounds leave it short."""
    kept: list[tuple[ScoredRound, int]] = []  # (round, prompt index in it)
    rounds, generated, dropped = 0, 0, 0
    round_ = first
    while True:
        rounds += 1
        num_prompts = len(round_.prompts.examples)
        generated += num_prompts
        varies = varying_groups(group_values(round_, config.metric), round_.batch.group_ids, num_prompts)
        kept += [(round_, int(i)) for i in varies.nonzero().flatten()]
        dropped += num_prompts - int(varies.sum())
        if len(kept) >= train_batch_size:
            break
        if 0 < config.max_num_gen_batches <= rounds:
            raise DynamicSamplingExhausted(
                f"step {step}: {len(kept)} of data.train_batch_size={train_batch_size} groups vary in "
                f"{config.metric!r} after {rounds} generation rounds "
                f"(algorithm.filter_groups.max_num_gen_batches={config.max_num_gen_batches}); the prompts may "
                "be too hard or too easy for the policy: raise the bound (0: none) or data.gen_batch_size"
            )
        round_ = more(rounds)
    surplus = len(kept) - train_batch_size
    batch, prompts = _merge(kept[:train_batch_size], n=n, pad_token_id=pad_token_id)
    batch.extra_metrics = dict(first.batch.extra_metrics)
    metrics = {
        NUM_GEN_BATCHES: float(rounds),
        GENERATED_PROMPTS: float(generated),
        KEPT_GROUPS: float(len(kept)),
        DROPPED_GROUPS: float(dropped),
        SURPLUS_GROUPS: float(surplus),
        KEPT_SCORE_MEAN: float(batch.scores.mean()),
    }
    return batch, prompts, metrics


def _merge(
    kept: list[tuple[ScoredRound, int]], *, n: int, pad_token_id: int
) -> tuple[StepBatch, PromptBatch]:
    """The samples of the ``kept`` groups in order, as one batch with group ids 0..len(kept)-1."""
    width = max(r.batch.input_ids.size(1) for r, _ in kept)
    parts = []
    for round_, prompt in kept:
        rows = torch.arange(prompt * n, (prompt + 1) * n)
        parts.append(_left_pad(round_.batch.select(rows), width, pad_token_id))
    batch = StepBatch.concat(_alike(parts))
    batch.group_ids = torch.arange(len(kept)).repeat_interleave(n)
    last = kept[-1][0].prompts
    prompts = PromptBatch(
        examples=[r.prompts.examples[i] for r, i in kept], epoch=last.epoch, position=last.position
    )
    return batch, prompts


def _alike(parts: list[StepBatch]) -> list[StepBatch]:
    """``parts`` with the optional per-token fields a round may lack filled where another has them:
    no turn rewards are zeros, no sampled mask is every response token (what None means)."""
    if any(p.turn_rewards is not None for p in parts):
        parts = [
            p if p.turn_rewards is not None else replace(p, turn_rewards=torch.zeros_like(p.rollout_logprobs))
            for p in parts
        ]
    if any(p.sampled_mask is not None for p in parts):
        parts = [
            p if p.sampled_mask is not None else replace(p, sampled_mask=p.response_mask.clone())
            for p in parts
        ]
    return parts


def _left_pad(batch: StepBatch, width: int, pad_token_id: int) -> StepBatch:
    """``batch`` with its prompt part left-padded so that rows are ``width`` wide."""
    extra = width - batch.input_ids.size(1)
    if extra == 0:
        return batch
    rows = batch.input_ids.size(0)
    pad_ids = torch.full((rows, extra), pad_token_id, dtype=batch.input_ids.dtype)
    pad_mask = torch.zeros((rows, extra), dtype=batch.attention_mask.dtype)
    return replace(
        batch,
        input_ids=torch.cat([pad_ids, batch.input_ids], dim=1),
        attention_mask=torch.cat([pad_mask, batch.attention_mask], dim=1),
        routed_experts=_left_pad_routes(batch.routed_experts, extra),
    )


def _left_pad_routes(routes: torch.Tensor | None, extra: int) -> torch.Tensor | None:
    """``routes`` ([batch, columns, layers, k]) with ``extra`` padding columns in front, whose
    experts are 0..k-1 as on any padding (:func:`~rltrain.data.step_batch.engine_routes`)."""
    if routes is None:
        return None
    rows, _, layers, k = routes.shape
    pad = torch.arange(k, dtype=routes.dtype).expand(rows, extra, layers, k)
    return torch.cat([pad, routes], dim=1)


def overlong_penalty(
    lengths: torch.Tensor, *, response_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """``[batch]`` penalties (<= 0) of responses of ``lengths`` tokens (see the module doc)."""
    expected = response_length - buffer_len
    exceed = lengths.float() - expected
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


def round_seed(seed: int, round_: int) -> int:
    """The sampling seed of generation round ``round_`` of a step whose first round uses ``seed``."""
    return seed + round_ * ROUND_SEED_STRIDE
