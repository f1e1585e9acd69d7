"""The vLLM backend's entry in the engine registry (``rollout.name: vllm``): builds the offline
engine (``VllmEngine``) or the asynchronous one (``AsyncVllmEngine``) and reads ``VllmOptions``
from the config. vLLM itself is imported when an engine is built, not here."""

from __future__ import annotations

from rltrain.rollout.protocol import EngineSettings, RolloutEngine
from rltrain.rollout.registry import EngineBackend
from rltrain.rollout.vllm.options import VllmOptions


def build(
    model_dir: str, settings: EngineSettings, *, asynchronous: bool, partial_rollout: bool
) -> RolloutEngine:
    """``AsyncVllmEngine`` where ``asynchronous`` (with ``partial_rollout``), else ``VllmEngine``; a
    CPU engine refuses multi-latent attention (:mod:`rltrain.rollout.vllm.cpu_mla`)."""
    from vllm.platforms import current_platform

    from rltrain.rollout.vllm.cpu_mla import refuse_mla_on_cpu

    refuse_mla_on_cpu(model_dir, cpu=current_platform.is_cpu())
    if asynchronous:
        from rltrain.rollout.vllm.async_engine import AsyncVllmEngine

        return AsyncVllmEngine(model_dir, settings=settings, partial_rollout=partial_rollout)
    from rltrain.rollout.vllm.engine import VllmEngine

    return VllmEngine(model_dir, settings=settings)


BACKEND = EngineBackend(name="vllm", build=build, options_from_config=VllmOptions.from_rollout_config)
