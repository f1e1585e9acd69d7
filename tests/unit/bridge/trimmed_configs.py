"""Trimmed ``config.json`` dicts: a model's config without the keys transformers fills in by itself.

Hand-written and trimmed configs leave such keys out; ``AutoConfig`` loads them as the same model.
Used by the unit tests of this folder and by ``tests/dist/bridge/test_bridge_trimmed_config.py``.
"""

from __future__ import annotations

import json
from typing import Any


def as_transformers_loads_it(config: dict[str, Any]) -> dict[str, Any]:
    """The full config transformers makes of a ``config.json`` dict (``AutoConfig.from_pretrained``
    reads the file with the same ``from_dict`` of the ``model_type``'s config class)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[config["model_type"]].from_dict(dict(config)).to_dict()


def trimmed(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without every key whose value transformers gives its ``model_type`` anyway (the
    config class's default, or what the class derives from the other keys); transformers loads the
    result as exactly ``config``, which each key's removal is checked against."""
    full = as_transformers_loads_it(config)
    kept = dict(config)
    for key in config:
        if key == "model_type":
            continue
        candidate = {k: v for k, v in kept.items() if k != key}
        if as_transformers_loads_it(candidate) == full:
            kept = candidate
    return kept


def config_json(config: Any) -> dict[str, Any]:
    """The dict of the ``config.json`` that ``save_pretrained`` would write for a ``PretrainedConfig``,
    with every key (the same values a saved tiny checkpoint's config holds)."""
    return json.loads(config.to_json_string(use_diff=False))
