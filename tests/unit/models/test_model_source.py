"""Model sources: tiny models built once per shape into the cache, warm-up that fits the task."""

import json

import pytest
import torch

from rltrain.config import DataConfig, GeneratedTaskConfig, ModelConfig, TinyModelConfig
from rltrain.models.source import resolve_model_dir
from rltrain.models.tiny import build_tiny_model, build_tiny_tokenizer
from rltrain.models.warmup import encode_pairs, sft_warmup


def test_tiny_model_is_cached_and_keyed_by_its_settings(tmp_path):
    data = DataConfig(generated=GeneratedTaskConfig(num_train=16, num_val=4, max_operand=5, ops=["+"]))
    model = ModelConfig(tiny=TinyModelConfig(seed=3), cache_dir=str(tmp_path))
    first = resolve_model_dir(model, data=data)
    assert (first / "config.json").is_file() and (first / "tokenizer.json").is_file()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_dir(model, data=data) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    other = resolve_model_dir(ModelConfig(tiny=TinyModelConfig(seed=4), cache_dir=str(tmp_path)), data=data)
    assert other != first
    config = json.loads((first / "config.json").read_text())
    assert config["vocab_size"] % 64 == 0 and config["vocab_size"] >= len(build_tiny_tokenizer())
    assert not list(tmp_path.glob(".*tmp*")), "no temporary directories left behind"


def test_missing_model_path_names_the_key(tmp_path):
    from rltrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"model\.path=.*no config\.json"):
        resolve_model_dir(ModelConfig(path=str(tmp_path)), data=DataConfig())


def test_warmup_fits_the_answers():
    model, tokenizer = build_tiny_model("llama", seed=0)
    pairs = [([{"role": "user", "content": f"What is {a} + 1?"}], str(a + 1)) for a in range(8)]
    result = sft_warmup(model, tokenizer, pairs, steps=60, batch_size=8, lr=3e-3, seed=0)
    assert result.first_loss > 4.0 and result.last_loss < 0.5 * result.first_loss
    # the loss covers only answer tokens + eos: recompute it independently on one pair
    ((prompt, answer),) = encode_pairs(tokenizer, pairs[:1])
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(answer))
    assert nll.item() < result.first_loss


def test_label_smoothed_warmup_loss_equals_the_hand_derived_mixture():
    """With smoothing e the loss on each answer token is (1 - e) · its negative log-probability plus
    e · the mean negative log-probability over the vocabulary; e = 0 is the model's own loss."""
    from rltrain.models.warmup import _answer_loss, _collate

    model, tokenizer = build_tiny_model("llama", seed=0)
    pairs = [([{"role": "user", "content": f"What is {a} + 2?"}], str(a + 2)) for a in (3, 9)]
    encoded = encode_pairs(tokenizer, pairs)
    pad = tokenizer.pad_token_id
    input_ids, labels = _collate([(p + a, [0] * len(p) + [1] * len(a)) for p, a in encoded], pad)
    with torch.no_grad():
        smoothed = _answer_loss(model, input_ids, labels, pad=pad, label_smoothing=0.35).item()
        plain = _answer_loss(model, input_ids, labels, pad=pad, label_smoothing=0.0).item()
        terms = []
        for prompt, answer in encoded:
            ids = torch.tensor([prompt + answer])
            logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].double(), dim=-1)
            for position, token in enumerate(answer):
                nll, uniform = -logp[position, token], -logp[position].mean()
                terms.append((nll.item(), uniform.item()))
    want_plain = sum(n for n, _ in terms) / len(terms)
    want_smoothed = sum(0.65 * n + 0.35 * u for n, u in terms) / len(terms)
    assert plain == pytest.approx(want_plain, rel=1e-5)
    assert smoothed == pytest.approx(want_smoothed, rel=1e-5)


def test_a_smoothed_warmup_answers_greedily_but_keeps_probability_off_the_answers():
    """The quickstart's starting policy: fitted with smoothing 0.35, every greedy answer is right, while
    each answer token keeps 0.35 of the probability off: the smoothed target's optimum puts
    1 - 0.35 + 0.35 / vocabulary on the answer token."""
    from rltrain.models.warmup import greedy_accuracy

    model, tokenizer = build_tiny_model("llama", seed=0)
    pairs = [([{"role": "user", "content": f"What is {a} + 1?"}], str(a + 1)) for a in range(8)]
    result = sft_warmup(
        model, tokenizer, pairs, steps=300, batch_size=8, lr=1e-3, seed=0, label_smoothing=0.35
    )
    assert greedy_accuracy(model, tokenizer, pairs) == 1.0
    # the logged loss ends near the floor it is reported against (the smoothed target's entropy)
    assert result.loss_floor <= result.last_loss <= result.loss_floor + 0.1, result
    probs = []
    with torch.no_grad():
        for prompt, answer in encode_pairs(tokenizer, pairs):
            logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
            probs += torch.softmax(logits, dim=-1)[torch.arange(len(answer)), torch.tensor(answer)].tolist()
    optimum = 1 - 0.35 + 0.35 / model.config.vocab_size
    assert probs == pytest.approx([optimum] * len(probs), abs=0.02)


def test_smoothed_loss_floor_is_the_loss_of_the_smoothed_target_itself():
    """torch's label-smoothed cross-entropy of logits equal to the smoothed target's log-probabilities
    is the smallest it can be; the floor the warm-up logs must equal it."""
    from rltrain.models.warmup import smoothed_loss_floor

    vocab, e = 448, 0.35
    target = torch.full((1, vocab), e / vocab, dtype=torch.float64)
    target[0, 5] += 1 - e
    reached = torch.nn.functional.cross_entropy(target.log(), torch.tensor([5]), label_smoothing=e)
    assert smoothed_loss_floor(e, vocab) == pytest.approx(reached.item(), rel=1e-12)
    assert smoothed_loss_floor(e, vocab) == pytest.approx(2.7781, abs=1e-4)
    assert smoothed_loss_floor(0.0, vocab) == 0.0


def test_a_tiny_model_from_a_config_file_is_that_config_with_the_tiny_vocabulary(tmp_path):
    """A released config (Moonlight, shrunk) → the built model's config.json holds every field of the
    file as given, but the vocabulary and special tokens (the tiny tokenizer's) and auto_map."""
    from tests.released import shrunk_config

    released = shrunk_config("moonlight-16b-a3b-instruct")
    (tmp_path / "moonlight.json").write_text(json.dumps(released))
    model = ModelConfig(
        tiny=TinyModelConfig(config_path=str(tmp_path / "moonlight.json")), cache_dir=str(tmp_path / "cache")
    )
    built = json.loads((resolve_model_dir(model, data=DataConfig()) / "config.json").read_text())
    changed = {"vocab_size", "eos_token_id", "pad_token_id", "bos_token_id", "auto_map", "torch_dtype"}
    # what transformers makes of the file (it moves rope_theta into rope_parameters, for one)
    from tests.unit.bridge.trimmed_configs import as_transformers_loads_it

    expected = as_transformers_loads_it(released)
    assert expected["hidden_size"] == 64 and expected["n_routed_experts"] == 8
    loaded = as_transformers_loads_it(built)
    different = {k for k in expected.keys() | loaded.keys() if expected.get(k) != loaded.get(k)}
    assert different <= changed | {"transformers_version", "dtype"}, different
    assert built["vocab_size"] % 64 == 0 and built["vocab_size"] >= len(build_tiny_tokenizer())
    assert "auto_map" not in built and resolve_model_dir(model, data=DataConfig()).name.startswith(
        "tiny-deepseek_v3-"
    )


def test_the_warm_up_of_a_stacked_expert_moe_repeats_bit_for_bit_on_two_threads():
    """GPT-OSS's transformers experts gather each expert's tokens by index; on more than one CPU thread
    the gradient of that gather adds rows in a racing order unless deterministic algorithms are on,
    and the warm-up (hence the whole run) came out different run to run (a CI run's GRPO test
    started from a model that no longer learned). Two warm-ups from one initialisation are equal."""
    from rltrain.data.tasks import generate_arithmetic
    from rltrain.models.tiny import tiny_model_from_config
    from tests.released import shrunk_config

    tokenizer = build_tiny_tokenizer()
    config = shrunk_config("gpt-oss-20b")
    config.pop("quantization_config", None)
    rows = generate_arithmetic(80, seed=1234, max_operand=9, ops=["+"])
    pairs = [(row["prompt"], row["reward_model"]["ground_truth"]) for row in rows]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fitted = []
        for _ in range(4):
            model = tiny_model_from_config(config, tokenizer=tokenizer, seed=0)
            sft_warmup(model, tokenizer, pairs, steps=30, batch_size=32, lr=3e-3, seed=0)
            fitted.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    finally:
        torch.set_num_threads(threads)
    assert not torch.are_deterministic_algorithms_enabled(), "the warm-up restores the global setting"
    for other in fitted[1:]:
        assert torch.equal(fitted[0], other), float((fitted[0] - other).abs().max())
