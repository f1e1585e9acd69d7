"""Rewards: rule functions by data_source, a sandboxed code reward, custom and remote scorers, a
format bonus, batch scoring.

Importing this package registers the built-in reward functions (``gsm8k``, ``openai/gsm8k``,
``arithmetic``, ``calculator``, and ``code`` with verl's code datasets); :class:`RewardManager`
scores a batch of decoded responses, with them or with a custom function (:mod:`.custom`) or a
remote service (:mod:`.remote`) that scores every row.
"""

from rltrain.rewards import code_exec as code_exec
from rltrain.rewards import math_answers as math_answers
from rltrain.rewards import tool_use as tool_use
from rltrain.rewards.external import RewardError, ScoreRequest
from rltrain.rewards.manager import RewardManager, RewardOutput
from rltrain.rewards.registry import (
    RewardResult,
    UnknownDataSourceError,
    get_reward_fn,
    register_reward,
    registered_data_sources,
)

__all__ = [
    "RewardError",
    "RewardManager",
    "RewardOutput",
    "RewardResult",
    "ScoreRequest",
    "UnknownDataSourceError",
    "get_reward_fn",
    "register_reward",
    "registered_data_sources",
]
