"""One tiny llama and ONE in-process vLLM engine shared by every rollout e2e test (engine start and
``import vllm`` cost ~20 s on this machine). Tests that change the engine's weights restore the
originals through the ``restore_weights`` fixture."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from rltrain.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama_weights(tiny_llama_dir) -> dict[str, torch.Tensor]:
    """The HF checkpoint's tensors, in checkpoint order (the order the bridge exports)."""
    from safetensors.torch import load_file

    return load_file(str(tiny_llama_dir / "model.safetensors"))


@pytest.fixture(scope="session")
def engine(tiny_llama_dir):
    from rltrain.rollout.protocol import EngineSettings
    from rltrain.rollout.vllm.engine import VllmEngine
    from rltrain.rollout.vllm.options import VllmOptions

    eng = VllmEngine(
        str(tiny_llama_dir),
        settings=EngineSettings(
            max_model_len=256, max_num_seqs=16, options=VllmOptions(kv_cache_space_gb=0.25)
        ),
    )
    yield eng
    eng.shutdown()


@pytest.fixture
def restore_weights(engine, tiny_llama_weights):
    """Give the test the engine and load the original weights back afterwards."""
    yield engine
    engine.load_weights(tiny_llama_weights.items())
