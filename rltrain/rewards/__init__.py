"""Rule-based rewards by data_source: GSM8K, generated arithmetic, a format bonus, batch scoring.

Importing this package registers the built-in reward functions (``gsm8k``, ``openai/gsm8k``,
``arithmetic``, ``calculator``); :class:`RewardManager` scores a batch of decoded responses.
"""

from rltrain.rewards import math_answers as math_answers
from rltrain.rewards import tool_use as tool_use
from rltrain.rewards.manager import RewardManager, RewardOutput
from rltrain.rewards.registry import (
    RewardResult,
    UnknownDataSourceError,
    get_reward_fn,
    register_reward,
    registered_data_sources,
)

__all__ = [
    "RewardManager",
    "RewardOutput",
    "RewardResult",
    "UnknownDataSourceError",
    "get_reward_fn",
    "register_reward",
    "registered_data_sources",
]
