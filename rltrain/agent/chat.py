"""Token ids of a conversation grown turn by turn, never re-tokenized.

The trajectory's tokens are the prompt's ids, then exactly the ids the engine sampled for each
assistant turn, and between turns the ids of the messages that answer it (tool results, an
interaction's next user message) with the chat template's own delimiters: the rest of the
template's end-of-assistant-turn marker, the messages, and the opening of the next assistant turn.

``ChatGlue.between_turns`` finds those delimiters by rendering a two-message reference
conversation with and without the new messages through the tokenizer's chat template and taking the
text that follows the assistant turn; only that text is encoded. Encoding it alone is exact for
templates whose messages are separated by special tokens (ChatML: Qwen, SmolLM2, Hermes), since a
special token never merges with its neighbours. A template that re-renders earlier turns when a
message is appended (so the conversation so far is not a prefix of the longer one) is refused by
name rather than silently given other tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_USER = "rltrain reference question"
_ASSISTANT = "rltrain reference answer"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be extended turn by turn."""


class ChatGlue:
    """Prompt ids and between-turn ids of one tokenizer's chat template (with the run's tool schemas)."""

    def __init__(self, tokenizer: Any, *, tools: Sequence[dict] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError("multi-turn rollouts need a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self._reference = [
            {"role": "user", "content": _USER},
            {"role": "assistant", "content": _ASSISTANT},
        ]
        self._reference_text = self._render(self._reference, add_generation_prompt=False)
        if _ASSISTANT not in self._reference_text:
            raise ChatTemplateError("the chat template drops the assistant's content; cannot place turns")
        # What the template writes after an assistant message's content (ChatML: "<|im_end|>\n").
        self._after_assistant = self._reference_text[
            self._reference_text.rindex(_ASSISTANT) + len(_ASSISTANT) :
        ]
        end_ids = self._encode(self._after_assistant)
        self.turn_end_id: int | None = end_ids[0] if end_ids else None
        """The token that ends an assistant turn in this template (ChatML's ``<|im_end|>``)."""

    def _render(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        if self.tools:
            kwargs["tools"] = self.tools
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The ids of ``messages`` rendered with the tool schemas and the assistant turn opened."""
        return self._encode(self._render(messages, add_generation_prompt=True))

    def between_turns(self, messages: list[dict], *, last_token: int) -> list[int]:
        """Ids to append after an assistant turn that ended with ``last_token``: the template's end of
        that turn (minus ``last_token`` itself when the model sampled it), ``messages``, and the
        opening of the next assistant turn."""
        if not messages:
            raise ValueError("between_turns needs at least one message")
        full = self._render([*self._reference, *messages], add_generation_prompt=True)
        if not full.startswith(self._reference_text):
            raise ChatTemplateError(
                "the chat template re-renders earlier turns when a message is appended; "
                "multi-turn rollouts need a template that only appends"
            )
        ids = self._encode(self._after_assistant + full[len(self._reference_text) :])
        if ids and ids[0] == last_token:
            ids = ids[1:]  # the model ended its turn with the template's own marker
        return ids
