"""Supervised warm-up conversations of the calculator task, in the exact tokens of a rollout.

Each conversation is what the agent loop would produce with a perfect policy, built with the same
:class:`~rltrain.agent.chat.ChatGlue` the loop uses (so the warm-up teaches the very tokens a
rollout samples and appends): the prompt with the tool schemas, an assistant turn calling the
calculator on the problem's expression, the tool's result, and an assistant turn answering with it.
A fraction of the conversations answers at once instead (``tool_call_fraction``): a tiny model
cannot add three-digit numbers in its head, so those answers are mostly wrong when sampled, which
leaves reinforcement learning a tool-calling habit to strengthen.
"""

from __future__ import annotations

import json
import random
from typing import Any

from rltrain.agent.chat import ChatGlue


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A Hermes-style call: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def calculator_conversations(
    tokenizer: Any,
    rows: list[dict[str, Any]],
    *,
    tools: list[dict],
    tool_call_fraction: float,
    seed: int,
) -> list[tuple[list[int], list[int]]]:
    """``(token ids, loss mask)`` per generated calculator row (``rltrain.data.tasks``): the mask is 1
    on the assistant's tokens (each turn's end marker included), 0 on the prompt and the tool turn."""
    glue = ChatGlue(tokenizer, tools=tools)
    end = glue.turn_end_id
    if end is None:
        raise ValueError("the chat template has no end-of-turn token to close the assistant's turns")
    encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    pick = random.Random(seed)
    out = []
    for row in rows:
        answer = row["reward_model"]["ground_truth"]
        prompt = glue.prompt_ids(row["prompt"])
        if pick.random() >= tool_call_fraction:
            reply = [*encode(answer), end]
            out.append((prompt + reply, [0] * len(prompt) + [1] * len(reply)))
            continue
        call = [*encode(tool_call_text("calculator", {"expression": row["extra_info"]["expression"]})), end]
        result = glue.between_turns([{"role": "tool", "content": answer}], last_token=end)
        reply = [*encode(answer), end]
        ids = prompt + call + result + reply
        mask = [0] * len(prompt) + [1] * len(call) + [0] * len(result) + [1] * len(reply)
        out.append((ids, mask))
    return out
