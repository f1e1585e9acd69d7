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
    with pytest.raises(FileNotFoundError, match=r"model\.path=.*no config\.json"):
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
