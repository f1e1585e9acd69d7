"""``feedback``: the built-in interaction — tell the model whether its answer is right, let it retry.

Each assistant turn is scored with the reward function of the row's ``data_source`` against its
ground truth. A correct answer ends the trajectory with reward ``correct_reward``; a wrong one gets
``wrong_reward`` and the message ``retry_message``, until ``multi_turn.max_user_turns`` messages or
the assistant-turn limit end it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rltrain.agent.interactions import Interaction, InteractionTurn, register_interaction
from rltrain.rewards.registry import get_reward_fn


@dataclass
class _State:
    ground_truth: str
    data_source: str


class FeedbackInteraction(Interaction):
    name = "feedback"

    def __init__(
        self,
        *,
        retry_message: str = "That is not correct. Try again.",
        correct_reward: float = 1.0,
        wrong_reward: float = 0.0,
    ) -> None:
        self.retry_message = retry_message
        self.correct_reward = correct_reward
        self.wrong_reward = wrong_reward

    async def start(self, *, ground_truth: str, data_source: str) -> _State:
        get_reward_fn(data_source)  # an unknown source fails here, naming the registered ones
        return _State(ground_truth, data_source)

    async def respond(self, state: _State, assistant_text: str, *, turn: int) -> InteractionTurn:
        result = get_reward_fn(state.data_source)(
            assistant_text, state.ground_truth, correct_score=1.0, format_score=0.0
        )
        if result.correct:
            return InteractionTurn(None, self.correct_reward)
        return InteractionTurn(self.retry_message, self.wrong_reward)


register_interaction("feedback", FeedbackInteraction)
