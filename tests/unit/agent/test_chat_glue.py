"""ChatGlue: between-turn ids equal the chat template's rendering of the whole conversation, minus
what came before; the warm-up conversations are those tokens exactly."""

from __future__ import annotations

import pytest

from rltrain.agent.chat import ChatGlue, ChatTemplateError
from rltrain.agent.warmup import calculator_conversations, tool_call_text
from rltrain.models.tiny import build_tiny_tokenizer, tool_call_corpus

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "", "parameters": {}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(corpus=tool_call_corpus())


def _template_ids(tokenizer, messages, *, tools=TOOLS, add_generation_prompt=True):
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return tokenizer.encode(text, add_special_tokens=False)


def test_turn_by_turn_ids_equal_the_template_of_the_whole_conversation(tokenizer):
    glue = ChatGlue(tokenizer, tools=TOOLS)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert glue.turn_end_id == end
    user = [{"role": "user", "content": "What is 482 + 397?"}]
    call = tool_call_text("calculator", {"expression": "482 + 397"})
    ids = glue.prompt_ids(user)
    assert ids == _template_ids(tokenizer, user)
    ids += [*tokenizer.encode(call, add_special_tokens=False), end]  # what the model samples
    ids += glue.between_turns([{"role": "tool", "content": "879"}], last_token=end)
    conversation = [*user, {"role": "assistant", "content": call}, {"role": "tool", "content": "879"}]
    assert ids == _template_ids(tokenizer, conversation)
    # the tool turn is exactly "\n<|im_start|>tool\n879<|im_end|>\n<|im_start|>assistant\n"
    glue_text = tokenizer.decode(glue.between_turns([{"role": "tool", "content": "879"}], last_token=end))
    assert glue_text == "\n<|im_start|>tool\n879<|im_end|>\n<|im_start|>assistant\n"


def test_a_turn_that_did_not_end_with_the_marker_gets_it_from_the_glue(tokenizer):
    glue = ChatGlue(tokenizer, tools=TOOLS)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = tokenizer.eos_token_id
    ids = glue.between_turns([{"role": "user", "content": "again"}], last_token=eos)
    assert ids[0] == end
    assert tokenizer.decode(ids) == "<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"


def test_without_tools_the_prompt_is_the_plain_template(tokenizer):
    user = [{"role": "user", "content": "hi"}]
    assert ChatGlue(tokenizer).prompt_ids(user) == _template_ids(tokenizer, user, tools=None)
    assert tokenizer.decode(ChatGlue(tokenizer, tools=TOOLS).prompt_ids(user)).startswith(
        "<|im_start|>system\nTools: calculator<|im_end|>\n"
    )


def test_templates_that_cannot_grow_turn_by_turn_are_refused(tokenizer):
    class Rerendering:
        chat_template = "x"

        def apply_chat_template(self, messages, **kwargs):  # numbers each message by the total count
            return "".join(f"{len(messages)}:{m['content']};" for m in messages)

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    glue = ChatGlue(Rerendering())
    with pytest.raises(ChatTemplateError, match="re-renders earlier turns"):
        glue.between_turns([{"role": "tool", "content": "1"}], last_token=0)

    class NoTemplate:
        chat_template = None

    with pytest.raises(ChatTemplateError, match="need a tokenizer with a chat template"):
        ChatGlue(NoTemplate())


def test_warmup_conversations_are_the_rollout_tokens_with_the_assistant_masked_in(tokenizer):
    rows = [
        {
            "prompt": [{"role": "user", "content": "What is 482 + 397?"}],
            "reward_model": {"ground_truth": "879"},
            "extra_info": {"expression": "482 + 397"},
        }
    ]
    (with_tool,) = calculator_conversations(tokenizer, rows, tools=TOOLS, tool_call_fraction=1.0, seed=0)
    (direct,) = calculator_conversations(tokenizer, rows, tools=TOOLS, tool_call_fraction=0.0, seed=0)
    ids, mask = with_tool
    call = tool_call_text("calculator", {"expression": "482 + 397"})
    conversation = [
        *rows[0]["prompt"],
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "879"},
        {"role": "assistant", "content": "879"},
    ]
    # the whole conversation as the template renders it, up to the final end-of-turn marker
    assert ids == _template_ids(tokenizer, conversation, add_generation_prompt=False)[:-1]
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained == call + "<|im_end|>879<|im_end|>"
    ids, mask = direct
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "879<|im_end|>"
