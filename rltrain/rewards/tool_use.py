"""Rewards of tool-using tasks: the answer the model gives after its last tool call.

``calculator``: the response is the model's turns concatenated (the tool results between them are
not part of it); the text after the last ``</tool_call>`` must be exactly the integer ground truth
(surrounding whitespace and a final period allowed). A model that answers without calling the tool
is scored the same way on its whole text.
"""

from __future__ import annotations

from rltrain.rewards.math_answers import extract_integer_answer, integer_ground_truth_problem
from rltrain.rewards.registry import RewardResult, register_reward

TOOL_CALL_END = "</tool_call>"


def final_answer_text(response: str) -> str:
    """What follows the last tool call of ``response`` (all of it without a call)."""
    return response.rsplit(TOOL_CALL_END, 1)[-1]


@register_reward("calculator", ground_truth=integer_ground_truth_problem)
def calculator_reward(
    response: str, ground_truth: str, *, correct_score: float = 1.0, format_score: float = 0.0
) -> RewardResult:
    """``correct_score`` if the final answer is the integer ground truth, ``format_score`` if it is
    another integer, else 0."""
    answer = extract_integer_answer(final_answer_text(response), method="strict")
    if answer is None:
        return RewardResult(score=0.0, correct=False, answer=None)
    correct = int(answer) == int(ground_truth.strip())
    return RewardResult(score=correct_score if correct else format_score, correct=correct, answer=answer)
