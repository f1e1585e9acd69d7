"""Data that crosses the rollout boundary: sampling parameters and generation output (the engine
settings are ``rltrain.rollout.protocol.EngineSettings``).

Pure module (no engine import): the orchestrator and the algorithm build and read these without
starting an engine. Field names follow verl's rollout vocabulary so that ``RolloutConfig`` maps onto
them one to one (see ``SamplingConfig.from_rollout_config``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling parameters of one ``generate`` call."""

    temperature: float = 1.0
    """Softmax temperature; 0 is greedy."""

    top_p: float = 1.0
    """Nucleus sampling mass."""

    top_k: int = -1
    """Top-k sampling; -1 disables."""

    n: int = 1
    """Samples per prompt."""

    response_length: int = 512
    """Maximum new tokens per sample."""

    stop: tuple[str, ...] = ()
    """Stop strings; the returned ids end with the token that completed the string (vLLM trims text only)."""

    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens besides the model's EOS ids (the stop token is returned)."""

    seed: int | None = None
    """Per-request seed: the same seed, prompt and weights give the same samples."""

    ignore_eos: bool = False
    """Sample past EOS tokens until ``response_length`` (stop strings and ``stop_token_ids`` still stop)."""

    @classmethod
    def from_rollout_config(cls, cfg: Any, *, seed: int | None = None) -> SamplingConfig:
        """Sampling from ``RolloutConfig`` (read by attribute); ``seed`` overrides ``cfg.seed``."""
        return cls(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            n=cfg.n,
            response_length=cfg.response_length,
            stop=tuple(cfg.stop),
            seed=cfg.seed if seed is None else seed,
            ignore_eos=cfg.ignore_eos,
        )


FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class Sample:
    """One sampled response of a request, as the engine returned it."""

    token_ids: list[int]
    """[response_len] sampled token ids, up to and including the EOS / stop token."""

    logprobs: list[float]
    """[response_len] log-probability of each sampled token under the engine's weights."""

    finish_reason: str
    """``stop``, ``length`` or ``abort`` (see ``RolloutOutput.finish_reasons``)."""

    stop_reason: int | str | None
    """The stop token id or stop string that ended the sample; None for EOS or length."""

    routed_experts: np.ndarray | None = None
    """[tokens, num_layers, top_k] the experts the engine's MoE routers chose for each token of
    prompt + response that it ran through the model (all but the last sampled token, which was never
    fed back), in sequence order; dense layers' slots hold no route. None: not asked for
    (``rltrain.rollout.protocol.EngineSettings.return_routed_experts``)."""


@dataclass
class RolloutOutput:
    """Result of one ``generate`` call over P prompts with n samples each (S = P·n samples).

    Sample ``s`` answers prompt ``s // n``; samples of one prompt are consecutive.
    """

    prompt_ids: list[list[int]]
    """[P][prompt_len_p] token ids of each prompt as the engine saw them (chat template applied)."""

    response_ids: list[list[int]]
    """[S][response_len_s] sampled token ids, up to and including the EOS / stop token, or the token that
    completed a stop string."""

    response_logprobs: list[list[float]]
    """[S][response_len_s] log-probability of each sampled token under the engine's weights."""

    finish_reasons: list[str]
    """[S] ``stop`` (EOS, stop token or stop string), ``length`` (hit response_length) or ``abort``."""

    n: int
    """Samples per prompt."""

    stop_reasons: list[int | str | None] = field(default_factory=list)
    """[S] the stop token id or stop string that ended the sample; None for EOS or length."""

    sampled_masks: list[list[int]] | None = None
    """[S][response_len_s] multi-turn responses: 1 on tokens the engine sampled, 0 on tool and
    environment tokens placed between turns (their logprob is 0.0); None: every token was sampled."""

    turn_rewards: list[list[tuple[int, float]]] | None = None
    """[S] an interaction's per-turn rewards as ``(response position, reward)`` pairs, the position
    being the last token of the assistant turn rewarded; None without an interaction."""

    sample_metrics: list[dict[str, float]] | None = None
    """[S] per-trajectory counts of the agent loop (``rltrain.agent.trajectory.TRAJECTORY_METRICS``)."""

    token_versions: list[list[int]] | None = None
    """[S][response_len_s] policy version of the weights that sampled each token, non-decreasing
    along a response (partial rollouts, ``rltrain.rollout.partial``); None: one version for the
    whole output, the one its caller generated it with."""

    routed_experts: list[np.ndarray] | None = None
    """[S] each ``[tokens_s, num_layers, top_k]``: the experts the engine routed sample ``s``'s prompt
    + response tokens to (``Sample.routed_experts``); None: the engine was not asked for them."""

    @property
    def num_samples(self) -> int:
        return len(self.response_ids)

    @staticmethod
    def from_samples(prompt_ids: list[list[int]], samples: list[list[Sample]], *, n: int) -> RolloutOutput:
        """The output of ``prompt_ids[p]`` answered by ``samples[p]`` (n each, in sample index order)."""
        if len(samples) != len(prompt_ids) or any(len(s) != n for s in samples):
            raise ValueError(
                f"{len(prompt_ids)} prompts need {n} samples each, got {[len(s) for s in samples]}"
            )
        flat = [sample for per_prompt in samples for sample in per_prompt]
        routes = [s.routed_experts for s in flat]
        return RolloutOutput(
            prompt_ids=prompt_ids,
            response_ids=[s.token_ids for s in flat],
            response_logprobs=[s.logprobs for s in flat],
            finish_reasons=[s.finish_reason for s in flat],
            n=n,
            stop_reasons=[s.stop_reason for s in flat],
            routed_experts=routes if any(r is not None for r in routes) else None,
        )

    @staticmethod
    def concat(parts: list[RolloutOutput], *, n: int) -> RolloutOutput:
        """The outputs of several engines, in order (each answering its share of the prompts)."""

        def joined(name: str) -> list | None:
            values = [getattr(p, name) for p in parts]
            return None if not values or values[0] is None else [x for v in values for x in v]

        return RolloutOutput(
            prompt_ids=[p for o in parts for p in o.prompt_ids],
            response_ids=[r for o in parts for r in o.response_ids],
            response_logprobs=[r for o in parts for r in o.response_logprobs],
            finish_reasons=[f for o in parts for f in o.finish_reasons],
            n=n,
            stop_reasons=[s for o in parts for s in o.stop_reasons],
            sampled_masks=joined("sampled_masks"),
            turn_rewards=joined("turn_rewards"),
            sample_metrics=joined("sample_metrics"),
            token_versions=joined("token_versions"),
            routed_experts=(
                [r for o in parts for r in (o.routed_experts or [None] * o.num_samples)]
                if any(o.routed_experts is not None for o in parts)
                else None
            ),  # an engine that returned none leaves its samples' entries None (the batch names them)
        )

    def sample_prompt_ids(self, s: int) -> list[int]:
        """Prompt ids of sample ``s``."""
        return self.prompt_ids[s // self.n]

    def padded(self, *, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(responses [S, L] long, logprobs [S, L] float32, mask [S, L] bool)`` right-padded to the
        longest response L; padded positions hold ``pad_token_id`` / 0.0 / False."""
        num = self.num_samples
        length = max((len(r) for r in self.response_ids), default=0)
        responses = torch.full((num, length), pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((num, length), dtype=torch.float32)
        mask = torch.zeros((num, length), dtype=torch.bool)
        for s, (ids, lps) in enumerate(zip(self.response_ids, self.response_logprobs)):
            responses[s, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logprobs[s, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
            mask[s, : len(ids)] = True
        return responses, logprobs, mask
