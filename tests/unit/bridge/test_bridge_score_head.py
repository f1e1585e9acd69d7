"""The reward model's head: an HF ``*ForSequenceClassification`` checkpoint through the bridge.

Its body is the causal LM's (same family, found by ``model_type``); ``score.weight`` [1, hidden]
becomes the scalar head ``output_layer.weight``, replicated over TP and never tied. A checkpoint
without it, or with num_labels != 1, is refused in one line naming the directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from megatron_bridge.bridge import Bridge
from megatron_bridge.errors import CheckpointError
from megatron_bridge.hf_io import HFCheckpointReader
from megatron_bridge.live import bridge_for_chunks, load_hf_weights
from megatron_bridge.registry import family_types
from rltrain.models.tiny import tiny_hf_config

# Families whose transformers has a *ForSequenceClassification class (none for glm4_moe: a GLM-4.5
# reward model's checkpoint has no transformers reference to test against)
FAMILIES = tuple(t for t in family_types() if t != "glm4_moe")
VOCAB = 96


def _save_classifier(root: Path, model_type: str, *, num_labels: int) -> Path:
    from transformers import AutoModelForSequenceClassification

    config = tiny_hf_config(model_type, vocab_size=VOCAB, num_labels=num_labels, pad_token_id=0)
    torch.manual_seed(7)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    out = root / f"{model_type}_labels{num_labels}"
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory) -> dict[str, Path]:
    """model_type -> a tiny one-label sequence-classifier checkpoint."""
    root = tmp_path_factory.mktemp("seq_cls")
    return {mt: _save_classifier(root, mt, num_labels=1) for mt in FAMILIES}


def _head_only_chunk(hidden: int) -> torch.nn.Module:
    """The last pipeline stage of a reward model reduced to its head (no layers, no embedding)."""
    chunk = torch.nn.Module()
    chunk.decoder = torch.nn.Module()
    chunk.decoder.layers = torch.nn.ModuleList()
    chunk.output_layer = torch.nn.Linear(hidden, 1, bias=False)
    torch.nn.init.zeros_(chunk.output_layer.weight)
    return chunk


def _tp_rank(rank: int, size: int) -> SimpleNamespace:
    return SimpleNamespace(tp_rank=rank, tp_size=size, ep_rank=0, ep_size=1, etp_size=size)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_score_head_table_covers_the_classifier_checkpoint_and_round_trips(classifiers, model_type):
    path = classifiers[model_type]
    config = json.loads((path / "config.json").read_text())
    hf = load_file(path / "model.safetensors")
    assert config["architectures"][0].endswith("ForSequenceClassification")
    bridge = Bridge.from_hf_config(config, head="score")
    lm_bridge = Bridge.from_hf_config(config)
    assert bridge.family is lm_bridge.family
    assert sorted(bridge.hf_names()) == sorted(hf)
    body = {"lm_head.weight"} if "lm_head.weight" in lm_bridge.hf_names() else set()
    assert set(bridge.hf_names()) - {"score.weight"} == set(lm_bridge.hf_names()) - body
    megatron = bridge.hf_to_megatron(hf)
    assert torch.equal(megatron["output_layer.weight"], hf["score.weight"])
    assert megatron["output_layer.weight"].shape == (1, config["hidden_size"])
    assert not bridge.unit_of_megatron("output_layer.weight")[0].tied
    back = bridge.megatron_to_hf(megatron)
    assert back.keys() == hf.keys() and all(torch.equal(back[n], hf[n]) for n in hf)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_score_weight_loads_whole_into_every_tp_rank(classifiers, model_type):
    path = classifiers[model_type]
    config = json.loads((path / "config.json").read_text())
    score = load_file(path / "model.safetensors")["score.weight"]
    for rank in range(2):
        ctx = _tp_rank(rank, 2)
        chunks = [_head_only_chunk(config["hidden_size"])]
        bridge = bridge_for_chunks(config, chunks, ctx, head="score")
        load_hf_weights(chunks, ctx, bridge, HFCheckpointReader(path))
        assert torch.equal(chunks[0].output_layer.weight, score)


def _load_error(path: Path, hidden: int) -> str:
    config = json.loads((path / "config.json").read_text())
    chunks = [_head_only_chunk(hidden)]
    ctx = _tp_rank(0, 1)
    with pytest.raises(CheckpointError) as err:
        load_hf_weights(
            chunks, ctx, bridge_for_chunks(config, chunks, ctx, head="score"), HFCheckpointReader(path)
        )
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    return message


def test_two_label_classifier_is_refused_naming_the_directory(tmp_path):
    path = _save_classifier(tmp_path, "llama", num_labels=2)
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    message = _load_error(path, hidden)
    assert f"score.weight has shape [2, {hidden}] (num_labels=2)" in message
    assert "needs num_labels=1" in message


def test_causal_lm_checkpoint_is_refused_naming_the_directory(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    message = _load_error(path, hidden)
    assert "has no score.weight" in message and "lm_head" in message
