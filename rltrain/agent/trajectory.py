"""``Trajectory``: one multi-turn rollout, token for token, and its counts.

The response holds the ids of every assistant turn as the engine sampled them and, between turns,
the ids of the tool results or environment messages that answered them. ``sampled_mask`` tells
them apart (1: sampled by the policy, with its logprob; 0: placed by the loop, logprob 0.0), so the
trainer recomputes logprobs over exactly the engine's context and trains on the model's tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rltrain.logging import metrics as mk

TRAJECTORY_METRICS = (
    mk.AGENT_TURNS,
    mk.AGENT_TOOL_CALLS,
    mk.AGENT_TOOL_ERRORS,
    mk.AGENT_TOOL_SECONDS,
    mk.AGENT_MODEL_TOKENS,
    mk.AGENT_TOOL_TOKENS,
    mk.AGENT_ABORTED,
)
"""Per-trajectory counts (``Trajectory.metrics``), averaged over the step by :func:`step_metrics`."""

if TYPE_CHECKING:
    import numpy as np


@dataclass
class Trajectory:
    prompt_ids: list[int]
    """The prompt as the engine saw it (chat template and tool schemas applied)."""

    response_ids: list[int] = field(default_factory=list)
    """Model turns and the messages between them, in order; at most the rollout's response_length."""

    sampled_mask: list[int] = field(default_factory=list)
    """Per response token: 1 if the engine sampled it, 0 for tool/environment tokens."""

    logprobs: list[float] = field(default_factory=list)
    """Per response token: the engine's logprob of a sampled token, 0.0 elsewhere."""

    finish_reason: str = "stop"
    """``stop`` (the model answered without a call, or the interaction ended it), ``length`` (the
    response budget ran out) or ``max_turns`` (``multi_turn.max_assistant_turns`` reached)."""

    stop_reason: int | str | None = None
    """The stop token of the last turn, as the engine reported it."""

    num_turns: int = 0
    """Assistant turns (engine requests)."""

    num_tool_calls: int = 0
    """Tool calls the model made, malformed ones included."""

    num_tool_errors: int = 0
    """Of those, the ones answered with an error (parse error, unknown tool, bad arguments, timeout...)."""

    tool_seconds: float = 0.0
    """Wall-clock spent in tools, all calls together."""

    aborted: bool = False
    """Cut at ``multi_turn.trajectory_timeout_s``."""

    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    """An interaction's rewards: (response position of the rewarded turn's last token, reward)."""

    routed_experts: np.ndarray | None = None
    """The engine's MoE routes (``Sample.routed_experts``) of the last turn's request, whose prompt
    is the whole trajectory before that turn: they cover every turn, earlier turns as routed in that
    request's prefill; tool tokens placed after the last turn have none. None: not asked for."""

    def add(self, ids: list[int], *, sampled: bool, logprobs: list[float] | None = None) -> None:
        self.response_ids += ids
        self.sampled_mask += [int(sampled)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    @property
    def num_model_tokens(self) -> int:
        return sum(self.sampled_mask)

    def metrics(self) -> dict[str, float]:
        return {
            mk.AGENT_TURNS: float(self.num_turns),
            mk.AGENT_TOOL_CALLS: float(self.num_tool_calls),
            mk.AGENT_TOOL_ERRORS: float(self.num_tool_errors),
            mk.AGENT_TOOL_SECONDS: self.tool_seconds,
            mk.AGENT_MODEL_TOKENS: float(self.num_model_tokens),
            mk.AGENT_TOOL_TOKENS: float(len(self.response_ids) - self.num_model_tokens),
            mk.AGENT_ABORTED: float(self.aborted),
        }


def step_metrics(per_sample: list[dict[str, float]]) -> dict[str, float]:
    """A step's agent metrics: per-trajectory means, the tool error rate (errors / calls) and the
    mean latency of a tool call."""
    if not per_sample:
        return {}
    num = len(per_sample)
    total = {k: sum(m[k] for m in per_sample) for k in TRAJECTORY_METRICS}
    calls = total[mk.AGENT_TOOL_CALLS]
    out = {k: v / num for k, v in total.items() if k != mk.AGENT_TOOL_SECONDS}
    out[mk.AGENT_TOOL_ERROR_RATE] = total[mk.AGENT_TOOL_ERRORS] / calls if calls else 0.0
    out[mk.AGENT_TOOL_LATENCY] = total[mk.AGENT_TOOL_SECONDS] / calls if calls else 0.0
    return out
