"""``StepBatch``: every sample of one PPO step, as the driver holds it between stages.

Rows are ``[prompt (left-padded) | response (right-padded)]`` with fixed widths for the step
(``prompt_len`` and ``response_len``), the layout the Megatron backend consumes. The rollout fills the
tokens and the rollout log-probs; later stages fill the optional fields in data-flow order. Pure
torch: the driver builds and slices it without Ray, vLLM or Megatron.

Every sample carries an id (``uids``) unique over the run and kept through every slice and merge:
``{prefix}-p{prompt}-s{sample}``, the prefix from :func:`step_uid_prefix` (the step, and the rollout
within it), ``prompt`` the prompt's index in that rollout's batch, ``sample`` its index among the
prompt's ``n``. The run's log file and the sample dumps name samples by it
(:mod:`rltrain.logging.samples`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch

_PER_SAMPLE_TENSORS = (
    "input_ids",
    "routed_experts",
    "attention_mask",
    "group_ids",
    "rollout_logprobs",
    "scores",
    "old_logprobs",
    "ref_logprobs",
    "values",
    "token_level_rewards",
    "advantages",
    "returns",
    "sampled_mask",
    "turn_rewards",
    "reward_baselines",
)
_PER_SAMPLE_LISTS = ("data_sources", "ground_truths", "finish_reasons", "uids", "extra_infos")


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    """[batch, prompt_len + response_len] long."""

    attention_mask: torch.Tensor
    """[batch, prompt_len + response_len] 1 on real tokens."""

    response_len: int
    """Columns of the response part (the rollout's ``response_length``)."""

    group_ids: torch.Tensor
    """[batch] long: index of the prompt in the step; samples of one prompt share it."""

    rollout_logprobs: torch.Tensor
    """[batch, response_len] log-probs the rollout engine reported for its samples (0 on padding)."""

    data_sources: list[str]
    """Per sample: the dataset's ``data_source`` (picks the reward function)."""

    ground_truths: list[str]
    """Per sample: the answer the reward function checks against."""

    finish_reasons: list[str]
    """Per sample: ``stop`` (EOS / stop string) or ``length`` (truncated)."""

    uids: list[str]
    """Per sample: its id (module doc), e.g. ``step3-p0-s1``."""

    extra_infos: list[dict[str, Any]] | None = None
    """Per sample: its prompt row's ``extra_info`` (verl's; custom and remote rewards receive it);
    None when the batch was built without them."""

    scores: torch.Tensor | None = None
    """[batch] float: rule reward of each response."""

    old_logprobs: torch.Tensor | None = None
    """[batch, response_len] actor log-probs before the update (π_old)."""

    ref_logprobs: torch.Tensor | None = None
    """[batch, response_len] reference-policy log-probs."""

    values: torch.Tensor | None = None
    """[batch, response_len] critic values before the update."""

    token_level_rewards: torch.Tensor | None = None
    """[batch, response_len] score at the last token, minus β·KL per token when KL is in the reward."""

    advantages: torch.Tensor | None = None
    """[batch, response_len]."""

    returns: torch.Tensor | None = None
    """[batch, response_len] value targets."""

    sampled_mask: torch.Tensor | None = None
    """[batch, response_len] 1 on the tokens the policy sampled; a multi-turn response also holds tool
    and environment tokens (0 here: attended to, never trained on). None: every real response token."""

    turn_rewards: torch.Tensor | None = None
    """[batch, response_len] per-turn rewards of an interaction, at the last token of each assistant
    turn (added to the token-level rewards); None without them."""

    reward_baselines: torch.Tensor | None = None
    """[batch] float: the reward of the greedy response to the sample's prompt (``remax``); None
    otherwise."""

    routed_experts: torch.Tensor | None = None
    """[batch, seq, num_layers, top_k] long: the experts each token went to in each MoE layer, aligned
    with ``input_ids`` (``actor.router_replay``: R2 the actor's old-logprob pass, R3 the engine);
    the reference and update passes replay them. None without routing replay."""

    extra_metrics: dict[str, float] = field(default_factory=dict)
    """Metrics produced while building the batch (e.g. over-long prompt counts)."""

    def __reduce__(self) -> tuple[Any, tuple]:
        """Pickled (every Ray call that carries a batch) with its tensors as numpy arrays. torch
        pickles each tensor's storage through a serializer of its own, about 0.1 ms a tensor, ten
        times numpy's: an update's four mini-batches of the quickstart took 3 ms to pickle and 2 ms
        to unpickle, 0.2 ms each way as arrays. Values, dtypes and shapes come back exactly, in
        tensors of their own (writable, sharing nothing with the sender); a tensor numpy cannot hold
        (bfloat16, off the CPU, requiring grad, not strided) is pickled by torch as before."""
        state, as_numpy = {}, []
        for f in fields(self):
            value = getattr(self, f.name)
            if _numpy_compatible(value):
                value = value.numpy()
                as_numpy.append(f.name)
            state[f.name] = value
        return _rebuild_step_batch, (state, tuple(as_numpy))

    @property
    def batch_size(self) -> int:
        return self.input_ids.size(0)

    @property
    def response_mask(self) -> torch.Tensor:
        """[batch, response_len] 1 on the response tokens the policy sampled (what rewards, advantages
        and losses cover): ``sampled_mask`` when set, else every real response token."""
        if self.sampled_mask is not None:
            return self.sampled_mask
        return self.attention_mask[:, -self.response_len :]

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, -self.response_len :]

    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())

    def select(self, index: torch.Tensor | list[int]) -> StepBatch:
        """The samples at ``index`` (in that order)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        updates = {}
        for name in _PER_SAMPLE_TENSORS:
            value = getattr(self, name)
            updates[name] = None if value is None else value[idx]
        for name in _PER_SAMPLE_LISTS:
            items = getattr(self, name)
            updates[name] = None if items is None else [items[i] for i in idx.tolist()]
        return replace(self, **updates, extra_metrics={})

    def chunk(self, num_chunks: int) -> list[StepBatch]:
        """``num_chunks`` contiguous equal parts (data-parallel dispatch); the size must divide."""
        if self.batch_size % num_chunks:
            raise ValueError(
                f"a batch of {self.batch_size} samples does not split into {num_chunks} equal parts"
            )
        size = self.batch_size // num_chunks
        return [self.select(list(range(i * size, (i + 1) * size))) for i in range(num_chunks)]

    @staticmethod
    def concat(parts: list[StepBatch]) -> StepBatch:
        """Inverse of :meth:`chunk` (fields must be filled alike in every part)."""
        first = parts[0]
        updates = {}
        for f in fields(StepBatch):
            if f.name in _PER_SAMPLE_TENSORS:
                values = [getattr(p, f.name) for p in parts]
                updates[f.name] = None if values[0] is None else torch.cat(values)
            elif f.name in _PER_SAMPLE_LISTS:
                values = [getattr(p, f.name) for p in parts]
                updates[f.name] = None if values[0] is None else [x for v in values for x in v]
        return replace(first, **updates)


_NUMPY_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
    | {torch.float16, torch.float32, torch.float64}
)


def _numpy_compatible(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and value.layout == torch.strided
        and value.dtype in _NUMPY_DTYPES
        and not value.requires_grad
    )


def _rebuild_step_batch(state: dict[str, Any], as_numpy: tuple[str, ...]) -> StepBatch:
    """Inverse of ``StepBatch.__reduce__``. An array unpickled from a buffer (in-band bytes, or
    Ray's object store) is read-only and is copied; one that owns writable memory is taken as is."""
    for name in as_numpy:
        array = state[name]
        state[name] = torch.from_numpy(
            array if array.flags.writeable and array.flags.owndata else array.copy()
        )
    return StepBatch(**state)


def build_step_batch(
    *,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    response_logprobs: list[list[float]],
    finish_reasons: list[str],
    n: int,
    data_sources: list[str],
    ground_truths: list[str],
    pad_token_id: int,
    response_length: int,
    sampled_masks: list[list[int]] | None = None,
    turn_rewards: list[list[tuple[int, float]]] | None = None,
    uid_prefix: str = "",
    extra_infos: list[dict[str, Any]] | None = None,
    routed_experts: list[Any] | None = None,
) -> StepBatch:
    """Pad rollout output (``n`` consecutive samples per prompt) into a :class:`StepBatch`.

    ``prompt_ids``, ``data_sources`` and ``ground_truths`` are per prompt; the response lists are per
    sample. Responses longer than ``response_length`` are an engine bug and raise. ``sampled_masks``
    (per sample, one 0/1 per response token) mark the tokens the policy sampled in a multi-turn
    response; ``turn_rewards`` (per sample, ``(response position, reward)`` pairs) are an interaction's
    per-turn rewards. ``uid_prefix`` (:func:`step_uid_prefix`) starts every sample's id; without one the
    ids (``p0-s1``) are unique within the batch only. ``extra_infos``: per prompt, the rows'
    ``extra_info`` (each sample gets its prompt's). ``routed_experts``: per sample, the engine's MoE
    routes over its prompt + response (``RolloutOutput.routed_experts``), placed on the same columns
    (:func:`engine_routes`).
    """
    num_samples = len(response_ids)
    if num_samples != n * len(prompt_ids):
        raise ValueError(f"{num_samples} responses for {len(prompt_ids)} prompts × n={n}")
    prompt_len = max(len(p) for p in prompt_ids)
    input_ids = torch.full((num_samples, prompt_len + response_length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    logprobs = torch.zeros(num_samples, response_length)
    for i, (ids, lps) in enumerate(zip(response_ids, response_logprobs)):
        if len(ids) > response_length or len(ids) != len(lps):
            raise ValueError(
                f"sample {i}: {len(ids)} tokens, {len(lps)} logprobs, response_length={response_length}"
            )
        if sampled_masks is not None and len(sampled_masks[i]) != len(ids):
            raise ValueError(f"sample {i}: {len(ids)} tokens but a sampled mask of {len(sampled_masks[i])}")
        prompt = prompt_ids[i // n]
        input_ids[i, prompt_len - len(prompt) : prompt_len] = torch.tensor(prompt)
        attention_mask[i, prompt_len - len(prompt) : prompt_len] = 1
        input_ids[i, prompt_len : prompt_len + len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, prompt_len : prompt_len + len(ids)] = 1
        logprobs[i, : len(lps)] = torch.tensor(lps)
    sampled = _per_token_mask(sampled_masks, response_length) if sampled_masks is not None else None
    rewards = None
    if turn_rewards is not None and any(turn_rewards):
        rewards = torch.zeros(num_samples, response_length)
        for i, pairs in enumerate(turn_rewards):
            for position, value in pairs:
                rewards[i, position] += value
    routes = None
    if routed_experts is not None:
        starts = [prompt_len - len(prompt_ids[i // n]) for i in range(num_samples)]
        routes = engine_routes(routed_experts, starts, attention_mask, response_length, sampled)
    return StepBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        routed_experts=routes,
        response_len=response_length,
        group_ids=torch.arange(len(prompt_ids)).repeat_interleave(n),
        rollout_logprobs=logprobs,
        data_sources=[s for s in data_sources for _ in range(n)],
        ground_truths=[g for g in ground_truths for _ in range(n)],
        finish_reasons=list(finish_reasons),
        uids=sample_uids(uid_prefix, len(prompt_ids), n),
        extra_infos=None if extra_infos is None else [e for e in extra_infos for _ in range(n)],
        sampled_mask=sampled,
        turn_rewards=rewards,
    )


def engine_routes(
    per_sample: list[Any],
    starts: list[int],
    attention_mask: torch.Tensor,
    response_length: int,
    sampled_mask: torch.Tensor | None,
) -> torch.Tensor:
    """``[batch, columns, num_layers, top_k]`` int16: each sample's engine routes (``[tokens, layers,
    k]`` from its first prompt token on, as vLLM returns them) placed from column ``starts[i]``. int16
    holds any expert id of vLLM's uint8/uint16 below 32768 in a quarter of long's bytes on the way to
    the workers. Columns without a route (padding; the last sampled token and any tool tokens after
    the engine's last request) hold experts ``0..k-1``: what routes there changes no trained log-prob.
    Raises, naming the sample, when routes are missing before a sampled token, run past the sample,
    differ in layers or top-k from the first sample's, or name an expert past int16."""
    rows, columns = attention_mask.shape
    first = next((r for r in per_sample if r is not None), None)
    if first is None:
        raise ValueError("routing replay R3: the rollout engine returned no routed_experts for any sample")
    if first.ndim != 3:
        raise ValueError(
            f"routing replay R3: routed_experts of shape {tuple(first.shape)}; expected [tokens, layers, top_k]"
        )
    shape = tuple(first.shape[1:])
    out = torch.arange(shape[1], dtype=torch.int16).expand(rows, columns, *shape).clone()
    responses = attention_mask[:, -response_length:]
    trained = sampled_mask.bool() if sampled_mask is not None else responses.bool()
    for i, r in enumerate(per_sample):
        prompt = int(attention_mask[i].sum() - responses[i].sum())
        total = prompt + int(responses[i].sum())
        last = trained[i].nonzero().flatten()
        needed = prompt + int(last[-1]) if len(last) else 0  # its log-prob reads every column before it
        got = 0 if r is None else len(r)
        if r is not None and tuple(r.shape[1:]) != shape:
            raise ValueError(
                f"routing replay R3: sample {i}'s routed_experts have shape {tuple(r.shape)}, "
                f"the first sample's {shape} per token ([tokens, layers, top_k])"
            )
        if not needed <= got <= total:
            raise ValueError(
                f"routing replay R3: sample {i} has engine routes for {got} tokens; its {prompt} prompt "
                f"and {total - prompt} response tokens need {needed} to {total}"
            )
        if got and int(r.max()) > torch.iinfo(torch.int16).max:
            raise ValueError(f"routing replay R3: sample {i} routes a token to expert {int(r.max())}")
        if got:
            out[i, starts[i] : starts[i] + got] = torch.from_numpy(np.asarray(r, dtype=np.int16))
    return out


def step_uid_prefix(step: int, rollout: str = "") -> str:
    """The id prefix of the samples of one rollout of ``step``: ``step3`` for the step's own,
    ``step3-r1`` for dynamic sampling's round 1 (``rollout="r1"``), ``step3-greedy`` for ReMax's
    greedy baselines, ``step3-val`` for a validation after step 3."""
    return f"step{step}-{rollout}" if rollout else f"step{step}"


def sample_uids(prefix: str, num_prompts: int, n: int) -> list[str]:
    """``{prefix}-p{prompt}-s{sample}`` for ``n`` consecutive samples of each prompt, in order."""
    head = f"{prefix}-" if prefix else ""
    return [f"{head}p{p}-s{s}" for p in range(num_prompts) for s in range(n)]


def _per_token_mask(masks: list[list[int]], response_length: int) -> torch.Tensor:
    out = torch.zeros(len(masks), response_length, dtype=torch.long)
    for i, mask in enumerate(masks):
        out[i, : len(mask)] = torch.tensor(mask, dtype=torch.long)
    return out
