"""The agent loop: each trajectory a coroutine on the asynchronous engine's event loop.

    generate → parse tool calls → run the tools → append their results → generate again

until the model answers without a call (or the interaction ends the conversation), the assistant
has had ``multi_turn.max_assistant_turns`` turns, or the response budget (``rollout.response_length``
tokens, model and tool tokens together) is spent. Token in, token out: each turn's request is the
prompt's ids plus everything so far, the engine's sampled ids are kept as they are, and what answers
a turn is added as the chat template's ids for those messages (:class:`~rltrain.agent.chat.ChatGlue`);
nothing is ever re-tokenized. ``Trajectory.sampled_mask`` marks the model's tokens.

Up to ``multi_turn.max_concurrent_trajectories`` trajectories are in flight; the engine batches
their requests continuously. Tools run concurrently with other trajectories' generation; a tool that
fails, hangs or floods its output answers with an error message (``rltrain.agent.tools``) and the
trajectory goes on. Sampling is reproducible: turn ``t`` of sample ``j`` of prompt ``i`` uses a seed
derived from (``sampling.seed``, ``i·n + j``, ``t``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from rltrain.agent.chat import ChatGlue
from rltrain.agent.trajectory import Trajectory
from rltrain.rollout.types import RolloutOutput, SamplingConfig

if TYPE_CHECKING:
    from rltrain.agent.interactions import Interaction
    from rltrain.agent.tools.base import ToolResult
    from rltrain.agent.tools.registry import ToolSet
    from rltrain.config.multi_turn import MultiTurnConfig
    from rltrain.rollout.types import Sample

log = logging.getLogger(__name__)

_SEED_MOD = 2**31 - 1


@dataclass(frozen=True)
class AgentPrompt:
    """One prompt of a multi-turn rollout."""

    prompt_ids: list[int]
    """Chat-templated ids (tool schemas included) with the assistant turn opened."""

    ground_truth: str = ""
    """What the interaction (if any) checks the answers against."""

    data_source: str = ""
    """The row's ``data_source`` (the interaction scores with its reward function)."""


class AsyncEngine(Protocol):
    """What the loop needs of :class:`~rltrain.rollout.protocol.AsyncRolloutEngine`."""

    tokenizer: Any

    async def agenerate(
        self, prompt_ids: list[int], sampling: SamplingConfig, *, request_id: str
    ) -> list[Sample]: ...

    def run(self, coro: Any, *, timeout_s: float | None = None, what: str = ...) -> Any: ...


def turn_seed(seed: int | None, sample: int, turn: int) -> int | None:
    """The sampling seed of ``turn`` of trajectory ``sample`` (None stays None: unseeded)."""
    if seed is None:
        return None
    return ((seed * 1_000_003 + sample) * 1_009 + turn) % _SEED_MOD


class AgentLoop:
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        config: MultiTurnConfig,
        tools: ToolSet | None = None,
        interaction: Interaction | None = None,
        tokenizer: Any = None,
    ) -> None:
        from rltrain.agent.tools.parser import get_parser

        self.engine, self.config = engine, config
        self.tools, self.interaction = tools, interaction
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self.chat = ChatGlue(self.tokenizer, tools=tools.schemas() if tools is not None else None)
        self.parse = get_parser(config.format)

    @classmethod
    def from_config(cls, engine: AsyncEngine, config: MultiTurnConfig) -> AgentLoop:
        """The loop with the tools and the interaction the config's files name."""
        from rltrain.agent.interactions import load_interaction
        from rltrain.agent.tools.registry import load_tool_config

        tools = load_tool_config(config.tool_config_path) if config.tool_config_path else None
        interaction = (
            load_interaction(config.interaction_config_path) if config.interaction_config_path else None
        )
        return cls(engine, config=config, tools=tools, interaction=interaction)

    # ------------------------------------------------------------------------------------------ run
    def generate(self, prompts: list[AgentPrompt], sampling: SamplingConfig) -> RolloutOutput:
        """``sampling.n`` trajectories per prompt, as a ``RolloutOutput`` (samples of a prompt
        consecutive) with the sampled masks, per-turn rewards and per-trajectory counts."""
        budget = self.config.trajectory_timeout_s * (1 + len(prompts) * sampling.n)
        trajectories = self.engine.run(
            self.run_all(prompts, sampling), timeout_s=budget, what=f"{len(prompts)} prompts' trajectories"
        )
        return to_rollout_output(prompts, trajectories, n=sampling.n)

    async def run_all(self, prompts: list[AgentPrompt], sampling: SamplingConfig) -> list[Trajectory]:
        """Every trajectory, at most ``max_concurrent_trajectories`` in flight; in sample order."""
        limit = asyncio.Semaphore(self.config.max_concurrent_trajectories)
        n = sampling.n

        async def bounded(index: int) -> Trajectory:
            async with limit:
                return await self.trajectory(prompts[index // n], sampling, sample=index)

        return list(await asyncio.gather(*(bounded(i) for i in range(len(prompts) * n))))

    async def trajectory(self, prompt: AgentPrompt, sampling: SamplingConfig, *, sample: int) -> Trajectory:
        """One trajectory; cut where it stands (``abort``) after ``trajectory_timeout_s``."""
        traj = Trajectory(prompt_ids=list(prompt.prompt_ids))
        try:
            await asyncio.wait_for(
                self._turns(traj, prompt, sampling, sample=sample), self.config.trajectory_timeout_s
            )
        except TimeoutError:
            log.warning(
                "trajectory %d ran past rollout.multi_turn.trajectory_timeout_s=%s; cut after %d turns",
                sample,
                self.config.trajectory_timeout_s,
                traj.num_turns,
            )
            traj.finish_reason = "abort"
            traj.aborted = True
        if not traj.response_ids:  # nothing sampled (aborted at once): one placeholder, never trained on
            traj.add([self.chat.turn_end_id or self.tokenizer.eos_token_id], sampled=False)
        return traj

    async def _turns(
        self, traj: Trajectory, prompt: AgentPrompt, sampling: SamplingConfig, *, sample: int
    ) -> None:
        cfg, budget = self.config, sampling.response_length
        state = None
        if self.interaction is not None:
            state = await self.interaction.start(
                ground_truth=prompt.ground_truth, data_source=prompt.data_source
            )
        user_turns = 0
        while True:
            turn_sampling = replace(
                sampling,
                n=1,
                response_length=budget - len(traj.response_ids),
                seed=turn_seed(sampling.seed, sample, traj.num_turns),
            )
            (out,) = await self.engine.agenerate(
                traj.prompt_ids + traj.response_ids,
                turn_sampling,
                request_id=f"traj{sample}-turn{traj.num_turns}-{id(traj):x}",
            )
            traj.add(list(out.token_ids), sampled=True, logprobs=list(out.logprobs))
            traj.routed_experts = out.routed_experts  # this request's prompt is every earlier turn
            traj.num_turns += 1
            traj.finish_reason, traj.stop_reason = out.finish_reason, out.stop_reason
            if out.finish_reason != "stop":  # the budget ran out (length) or the engine aborted it
                return
            text = self.tokenizer.decode(list(out.token_ids), skip_special_tokens=True)
            messages = await self._tool_messages(traj, text) if self.tools is not None else []
            if not messages and self.interaction is not None and user_turns < cfg.max_user_turns:
                answer = await self.interaction.respond(state, text, turn=traj.num_turns)
                if answer.reward is not None:
                    traj.turn_rewards.append((len(traj.response_ids) - 1, float(answer.reward)))
                if answer.message is not None:
                    messages = [{"role": "user", "content": answer.message}]
                    user_turns += 1
            if not messages:
                traj.finish_reason = "stop"
                return
            if traj.num_turns >= cfg.max_assistant_turns:
                traj.finish_reason = "max_turns"
                return
            glue = self.chat.between_turns(messages, last_token=out.token_ids[-1])
            if len(traj.response_ids) + len(glue) >= budget:  # no room left for the model to answer
                traj.finish_reason = "length"
                return
            traj.add(glue, sampled=False)

    async def _tool_messages(self, traj: Trajectory, text: str) -> list[dict[str, str]]:
        """The tool messages answering a turn's calls (parse errors included); [] without calls."""
        from rltrain.agent.tools.base import ToolResult

        parsed = self.parse(text)
        if not parsed.calls and not parsed.errors:
            return []
        cfg = self.config
        results: list[ToolResult] = [ToolResult.failure("parse_error", f"error: {e}") for e in parsed.errors]
        if parsed.calls:
            results += await self.tools.run(  # type: ignore[union-attr]
                parsed.calls,
                max_parallel_calls=cfg.max_parallel_calls,
                timeout_s=cfg.tool_timeout_s,
                max_output_chars=cfg.max_tool_response_length,
            )
        traj.num_tool_calls += len(results)
        traj.num_tool_errors += sum(not r.ok for r in results)
        traj.tool_seconds += sum(r.seconds for r in results)
        return [{"role": "tool", "content": r.text} for r in results]


def to_rollout_output(prompts: list[AgentPrompt], trajectories: list[Trajectory], *, n: int) -> RolloutOutput:
    """Trajectories (``n`` consecutive per prompt) as the rollout's output."""
    routes = [t.routed_experts for t in trajectories]
    return RolloutOutput(
        prompt_ids=[list(p.prompt_ids) for p in prompts],
        response_ids=[t.response_ids for t in trajectories],
        response_logprobs=[t.logprobs for t in trajectories],
        finish_reasons=[t.finish_reason for t in trajectories],
        n=n,
        stop_reasons=[t.stop_reason for t in trajectories],
        sampled_masks=[t.sampled_mask for t in trajectories],
        turn_rewards=[t.turn_rewards for t in trajectories],
        sample_metrics=[t.metrics() for t in trajectories],
        routed_experts=routes if any(r is not None for r in routes) else None,
    )
