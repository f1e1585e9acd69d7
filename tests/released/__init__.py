"""Released ``config.json`` files of real checkpoints, as test data, and their tiny random models.

Each checkpoint has a folder here named after its Hugging Face repository (``deepseek-v3``,
``qwen3-8b-yarn``, ...) holding:

- ``config.json``: the released file, byte for byte as published (``source`` in ``shrink.yaml`` says
  where it was copied from);
- ``shrink.yaml``: ``source`` (where the file comes from), and ``shrink``: every field changed to make
  the model tiny, each ``key: {value: ..., why: ...}`` (a dotted key reaches into a nested dict:
  ``rope_scaling.original_max_position_embeddings``). Only size fields may change (``SIZE_KEYS``,
  checked by ``tests/unit/models/test_released_configs.py``): layers, widths, head counts, expert
  counts, vocabulary, lengths. Everything else (RoPE type and factors, routing, norms, biases, MTP
  and sliding-window settings) stays as released, except what ``documented`` lists: a setting the
  checkpoint's own model card tells users to add to ``config.json`` (Qwen3's YaRN block for long
  context), each ``key: {value: ..., why: ..., cite: ...}``, applied before the shrink.

``shrunk_config(name)`` gives the tiny config dict; ``save_released_model(out_dir, name)`` builds the
tiny random model from it with transformers (the reference) and saves it with the tiny tokenizer.
A ``model_type`` transformers has no class for (Kimi-K2's ``kimi_k2``, whose class is remote code)
is built with the class ``megatron_bridge.hf_config.CONFIG_CLASS_OF`` names (``DeepseekV3Config``)
and saved under its released ``model_type``, as the real checkpoint is.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).parent

SIZE_KEYS = frozenset(
    {
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "n_group",
        "topk_group",
        "first_k_dense_replace",
        "vocab_size",
        "max_position_embeddings",
        "sliding_window",
        "layer_types",
        "rope_scaling.original_max_position_embeddings",
        "rope_parameters.original_max_position_embeddings",
    }
)
"""The fields a shrink may change: sizes and counts (a list like ``layer_types`` only in length)."""


def released_names() -> list[str]:
    return sorted(p.name for p in HERE.iterdir() if (p / "config.json").is_file())


def released_config(name: str) -> dict[str, Any]:
    """The released ``config.json`` of checkpoint ``name``, as published."""
    return json.loads((HERE / name / "config.json").read_text())


def shrink_table(name: str) -> dict[str, Any]:
    """``shrink.yaml`` of ``name``: ``source``, ``shrink`` (key → {value, why}) and optionally
    ``documented`` (key → {value, why, cite})."""
    return yaml.safe_load((HERE / name / "shrink.yaml").read_text())


def shrunk_config(name: str, **overrides: Any) -> dict[str, Any]:
    """The released config of ``name`` with its shrink applied (then ``overrides``, top-level keys)."""
    config = copy.deepcopy(released_config(name))
    table = shrink_table(name)
    for key, change in [*table.get("documented", {}).items(), *table["shrink"].items()]:
        *parents, leaf = key.split(".")
        target = config
        for parent in parents:
            target = target[parent]
        target[leaf] = copy.deepcopy(change["value"])
    config.update(overrides)
    return config


def save_released_model(out_dir: str | Path, name: str, *, seed: int = 0, **overrides: Any) -> Path:
    """Build the tiny random model of ``name`` (transformers, fp32) and save it with the tiny
    tokenizer; the vocabulary is the tokenizer's, padded to a multiple of 64. A released FP8/MXFP4
    ``quantization_config`` is left out (the tiny model is a float32 one). Returns the folder."""
    from rltrain.models.tiny import (
        build_tiny_tokenizer,
        save_pretrained_with_tokenizer,
        tiny_model_from_config,
    )

    tokenizer = build_tiny_tokenizer()
    config = shrunk_config(name, **overrides)
    config.pop("quantization_config", None)
    released_type = config["model_type"]
    model = tiny_model_from_config(config, tokenizer=tokenizer, seed=seed)
    out = save_pretrained_with_tokenizer(model, tokenizer, out_dir)
    saved = json.loads((out / "config.json").read_text())
    if saved["model_type"] != released_type:  # kimi_k2, built by DeepseekV3Config
        saved["model_type"] = released_type
        (out / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    return out
