"""Reading an HF config as transformers does, without importing transformers.

Contract: ``config_value(config, *names, default=...)`` reads a ``PretrainedConfig`` (its attributes)
or the dict of a ``config.json``. A ``config.json`` may leave out any key whose value is the default
of its ``model_type``'s transformers config class (``AutoConfig`` fills it in; hand-written and
trimmed configs do this); for a dict, a left-out key reads as the default that the registered family
of its ``model_type`` declares (``ModelFamily.hf_defaults``). Every reader of config keys in the
bridge (facts, dims, layout) goes through here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def config_value(config: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` that ``config`` sets to a non-None value, as transformers reads it.

    ``config``: a ``PretrainedConfig`` (its attributes), or the dict of a ``config.json``: its keys,
    and where the dict leaves out every one of ``names``, the transformers default that the family of
    its ``model_type`` declares (``ModelFamily.hf_defaults``); a key set to null stays null. ``default``
    where none of ``names`` has a value (keys the transformers class does not define, dicts of no
    registered ``model_type``).
    """
    if not isinstance(config, Mapping):
        values = [getattr(config, name, None) for name in names]
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
