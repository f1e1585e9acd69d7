"""Reading an HF config as transformers does, without importing transformers.

Contract: ``config_value(config, *names, default=...)`` reads a ``PretrainedConfig`` (its attributes)
or the dict of a ``config.json``. A ``config.json`` may leave out any key whose value is the default
of its ``model_type``'s transformers config class (``AutoConfig`` fills it in; hand-written and
trimmed configs do this); for a dict, a left-out key reads as the default that the registered family
of its ``model_type`` declares (``ModelFamily.hf_defaults``). Every reader of config keys in the
bridge (facts, dims, layout) goes through here.

``load_hf_config(model_dir)`` is ``AutoConfig.from_pretrained`` that also reads the checkpoints whose
``model_type`` transformers has no class for but whose file another class reads exactly
(``CONFIG_CLASS_OF``: Kimi-K2's ``kimi_k2`` is DeepSeek-V3's ``DeepseekV3Config``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONFIG_CLASS_OF = {"kimi_k2": "deepseek_v3"}
"""``model_type`` of a released ``config.json`` → the transformers ``model_type`` whose config class
reads it (the checkpoint's own class is remote code: Kimi-K2 ships DeepSeek-V3's
``configuration_deepseek.py`` under its own ``model_type``)."""


def config_value(config: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` that ``config`` sets to a non-None value, as transformers reads it.

    ``config``: a ``PretrainedConfig`` (its attributes), or the dict of a ``config.json``: its keys;
    where the dict or the instance has none of ``names``, the transformers default that the family of
    its ``model_type`` declares (``ModelFamily.hf_defaults``); a key set to null stays null. ``default``
    where none of ``names`` has a value (keys the transformers class does not define, dicts of no
    registered ``model_type``).
    """
    if not isinstance(config, Mapping):
        values = [getattr(config, name) for name in names if hasattr(config, name)]
        if not values:
            # a key this transformers release's class does not define yet (it hard-codes the value
            # in the model: GPT-OSS's swiglu_alpha before 5.19) reads as the family's default
            defaults = _hf_defaults(getattr(config, "model_type", None))
            values = [defaults.get(name) for name in names]
    else:
        # Every name present first: an alias in the file (num_local_experts) beats a default of its key.
        defaults = _hf_defaults(config.get("model_type"))
        values = [config[name] for name in names if name in config]
        values += [defaults.get(name) for name in names if name not in config]
    return next((value for value in values if value is not None), default)


def _hf_defaults(model_type: Any) -> Mapping[str, Any]:
    # imported here: the registry imports family.py, which imports this module
    from megatron_bridge.registry import registered_family

    family = registered_family(model_type) if isinstance(model_type, str) else None
    return family.hf_defaults if family is not None else {}


def load_hf_config(model_dir: str | Path, *, trust_remote_code: bool = False) -> Any:
    """The ``PretrainedConfig`` of the checkpoint in ``model_dir``, as ``AutoConfig`` reads it; a
    ``model_type`` of ``CONFIG_CLASS_OF`` without ``trust_remote_code`` through the class named there
    (whose ``model_type`` the instance then has: ``deepseek_v3`` for ``kimi_k2``)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    data = json.loads((Path(model_dir) / "config.json").read_text())
    model_type = data.get("model_type")
    if model_type in CONFIG_CLASS_OF and not trust_remote_code:
        # Without its model_type: an instance saying kimi_k2 would miss transformers' per-model
        # weight conversions (its per-expert checkpoint tensors would not load).
        del data["model_type"]
        return CONFIG_MAPPING[CONFIG_CLASS_OF[model_type]].from_dict(data)
    return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
