"""Multi-turn rollouts with tools and interactions (verl's ``rollout.multi_turn`` vocabulary)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rltrain.config.fields import PositiveFloat, PositiveInt


@dataclass
class MultiTurnConfig:
    enable: bool = False
    """Roll out each prompt as a trajectory of the agent loop (``rltrain.agent``): generate, run the
    tools it calls, append their results, generate again. Needs the asynchronous engine."""

    max_assistant_turns: PositiveInt = 4
    """Assistant turns per trajectory at most (the engine samples this many times at most)."""

    max_user_turns: PositiveInt = 4
    """Messages an interaction may add per trajectory at most."""

    tool_config_path: str | None = None
    """A YAML file of tools (name, JSON-schema parameters, implementation); see ``rltrain.agent.tools``."""

    interaction_config_path: str | None = None
    """A YAML file naming the interaction that answers assistant turns (``rltrain.agent.interactions``)."""

    format: Literal["hermes"] = "hermes"
    """Tool-call syntax the model writes: ``hermes`` is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    (Hermes, Qwen2.5, Qwen3)."""

    max_parallel_calls: PositiveInt = 1
    """Tool calls of one assistant turn that run; any more get an error message."""

    max_tool_response_length: PositiveInt = 256
    """Characters of a tool's output the model sees (longer output is cut, and says so)."""

    tool_timeout_s: PositiveFloat = 10.0
    """Wall-clock limit of one tool call."""

    trajectory_timeout_s: PositiveFloat = 600.0
    """Wall-clock limit of one trajectory: one that runs longer is cut where it stands
    (``finish_reason`` abort, counted in ``agent/aborted``) and the step goes on."""

    max_concurrent_trajectories: PositiveInt = 64
    """Trajectories in flight at once per engine (the engine batches their requests continuously)."""

    def validate(self, prefix: str) -> list[str]:
        if self.enable and not (self.tool_config_path or self.interaction_config_path):
            return [
                f"{prefix}.enable=true needs {prefix}.tool_config_path or {prefix}.interaction_config_path"
            ]
        return []
