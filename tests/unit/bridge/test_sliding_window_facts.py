"""Which layers slide, and over how many keys, read from an HF config as transformers reads it.

Reference: the installed transformers' own derivation (``layer_types`` and ``sliding_window`` after its
config class's ``__post_init__``), for the config object and for its ``config.json`` dict with and
without ``layer_types`` (files written before transformers 5 have none)."""

from __future__ import annotations

import pytest
from transformers import CONFIG_MAPPING

from megatron_bridge.registry import get_family

SHAPE = dict(num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
CASES = [
    ("qwen2", dict(use_sliding_window=True, sliding_window=7, max_window_layers=2)),
    ("qwen2", dict(use_sliding_window=False, sliding_window=131072, max_window_layers=2)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=7, max_window_layers=4)),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=7, max_window_layers=5)),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=7)),
    ("qwen3_moe", dict(use_sliding_window=False, sliding_window=7)),
    ("mixtral", dict(sliding_window=7)),
    ("mixtral", dict(sliding_window=None)),
    ("llama", dict()),
]


def transformers_sliding_layers(config) -> tuple[int | None, tuple[int, ...]]:
    """What transformers' modeling code applies: the window of each layer (None: full attention)."""
    window = getattr(config, "sliding_window", None) or None
    kinds = getattr(config, "layer_types", None)
    if window is None:
        return None, ()
    if kinds is None:  # Mixtral, Qwen3-MoE: one mask function for every layer
        return window, tuple(range(config.num_hidden_layers))
    return window, tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")


@pytest.mark.parametrize(("model_type", "settings"), CASES)
def test_sliding_layers_are_transformers_layers(model_type: str, settings: dict) -> None:
    config = CONFIG_MAPPING[model_type](**SHAPE, **settings)
    expected = transformers_sliding_layers(config)
    facts = get_family(model_type).facts
    as_file = {"model_type": model_type, **SHAPE, **settings}  # a trimmed config.json, no layer_types
    saved = config.to_dict()  # what transformers 5 writes
    for source in (config, as_file, saved):
        got = facts(source)
        assert (got.sliding_window, got.sliding_layers) == expected, (source, expected)


def test_some_cases_slide_and_some_layers_do_not() -> None:
    """The table above is not vacuous: windows on all, some and no layers."""
    layers = {transformers_sliding_layers(CONFIG_MAPPING[t](**SHAPE, **s))[1] for t, s in CASES}
    assert {(), tuple(range(6)), (2, 3, 4, 5), (0, 2, 4)} <= layers


def test_other_layer_types_are_refused_naming_them() -> None:
    config = {"model_type": "qwen2", **SHAPE, "use_sliding_window": True, "sliding_window": 4}
    config["layer_types"] = ["chunked_attention"] + ["full_attention"] * 5
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        get_family("qwen2").facts(config)
