"""The rollout engine against independent references: HF transformers' logprobs, the tokenizer's own
chat template, the checkpoint's tensors, and the engine itself before/after weight loads."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from rltrain.rollout.types import SamplingConfig

pytestmark = pytest.mark.e2e

PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 3, 150], [1, 340, 202, 371, 296, 224, 21]]
GREEDY = SamplingConfig(temperature=0.0, response_length=12)


def hf_response_logprobs(model_dir, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """log p(response_t | prompt, response_<t) from HF transformers in fp32."""

    model = _hf_model(model_dir)
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


_HF_CACHE: dict = {}


def _hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF_CACHE:
        _HF_CACHE[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _HF_CACHE[model_dir]


def test_sampled_logprobs_match_transformers(engine, tiny_llama_dir):
    out = engine.generate(PROMPTS, SamplingConfig(temperature=1.0, n=2, response_length=16, seed=3))
    assert out.num_samples == 6 and out.n == 2
    worst = 0.0
    for s in range(out.num_samples):
        ref = hf_response_logprobs(tiny_llama_dir, out.sample_prompt_ids(s), out.response_ids[s])
        got = torch.tensor(out.response_logprobs[s], dtype=torch.float64)
        worst = max(worst, float((got - ref).abs().max()))
    print(f"vLLM vs transformers sampled-token logprobs: max abs diff {worst:.2e}")
    assert worst < 1e-3, worst
    # the two samples of a prompt differ (sampling, not greedy) and the same seed reproduces them
    assert out.response_ids[0] != out.response_ids[1]
    again = engine.generate(PROMPTS, SamplingConfig(temperature=1.0, n=2, response_length=16, seed=3))
    assert again.response_ids == out.response_ids


def test_chat_template_matches_tokenizer(engine):
    from rltrain.models.tiny import build_tiny_tokenizer

    messages = [
        {"role": "system", "content": "Answer with the number only."},
        {"role": "user", "content": "What is 12 + 7?"},
    ]
    expected = build_tiny_tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )["input_ids"]
    assert engine.apply_chat_template(messages) == expected
    out = engine.generate([messages, PROMPTS[0]], GREEDY)
    assert out.prompt_ids == [expected, PROMPTS[0]]


def test_finish_reasons_stop_token_stop_string_and_length(engine):
    base = engine.generate([PROMPTS[0]], GREEDY)
    ids = base.response_ids[0]
    assert base.finish_reasons == ["length"] and len(ids) == GREEDY.response_length
    # a stop token: greedy decoding ends on its first occurrence, the token included
    stop_tok = ids[3]
    first = ids.index(stop_tok)
    out = engine.generate(
        [PROMPTS[0]], SamplingConfig(temperature=0.0, response_length=12, stop_token_ids=(stop_tok,))
    )
    assert out.response_ids[0] == ids[: first + 1]
    assert out.finish_reasons == ["stop"] and out.stop_reasons == [stop_tok]
    assert out.response_logprobs[0] == base.response_logprobs[0][: first + 1]
    # a stop string: the ids end with the token that completed it (vLLM trims only the text)
    text = engine.tokenizer.decode(ids)
    stop_str = text[len(text) // 2 : len(text) // 2 + 2]
    out = engine.generate([PROMPTS[0]], SamplingConfig(temperature=0.0, response_length=12, stop=(stop_str,)))
    got = out.response_ids[0]
    assert out.finish_reasons == ["stop"] and out.stop_reasons == [stop_str]
    assert got == ids[: len(got)] and len(got) < len(ids)
    assert stop_str in engine.tokenizer.decode(got) and stop_str not in engine.tokenizer.decode(got[:-1])


def test_ignore_eos_samples_past_the_eos_token_to_the_full_length(engine):
    """rollout.ignore_eos: the samples that ended on EOS go on, the same tokens up to and including
    the EOS (the per-request seed draws the same) and then to ``response_length``."""
    eos = engine.tokenizer.eos_token_id
    sampling = SamplingConfig(temperature=2.0, n=64, response_length=16, seed=11)
    ended = engine.generate(PROMPTS, sampling)
    on_eos = [s for s in range(ended.num_samples) if ended.response_ids[s][-1] == eos]
    assert on_eos and all(ended.finish_reasons[s] == "stop" for s in on_eos)  # a real comparison
    assert any(len(ended.response_ids[s]) < 16 for s in on_eos)
    full = engine.generate(PROMPTS, replace(sampling, ignore_eos=True))
    assert all(len(ids) == 16 for ids in full.response_ids) and set(full.finish_reasons) == {"length"}
    for s in on_eos:
        got, want = full.response_ids[s], ended.response_ids[s]
        assert got[: len(want)] == want, s
        assert full.response_logprobs[s][: len(want)] == pytest.approx(ended.response_logprobs[s], abs=1e-6)


def test_padded_output_matches_lists(engine):
    out = engine.generate(
        PROMPTS[:2], SamplingConfig(temperature=1.0, n=2, response_length=6, seed=1, stop_token_ids=(7,))
    )
    responses, logprobs, mask = out.padded(pad_token_id=3)
    for s in range(out.num_samples):
        n = len(out.response_ids[s])
        assert mask[s].sum() == n and responses[s, :n].tolist() == out.response_ids[s]
        assert torch.equal(logprobs[s, :n], torch.tensor(out.response_logprobs[s]))
        assert (responses[s, n:] == 3).all()


def test_sleep_on_cpu_logs_once_and_skips(engine, caplog):
    with caplog.at_level(logging.INFO, logger="rltrain.rollout.vllm.core"):
        engine.sleep()
        engine.wake_up()
        engine.sleep(level=2)
        engine.wake_up()
    messages = [r.getMessage() for r in caplog.records if "sleep" in r.getMessage()]
    assert len(messages) == 1 and "unsupported on CPU; skipped" in messages[0]
    levels = [r.levelno for r in caplog.records if "sleep" in r.getMessage()]
    assert levels == [logging.INFO]  # expected on CPU: not a warning
    assert engine.generate([PROMPTS[0]], GREEDY).finish_reasons == ["length"]  # still serving
