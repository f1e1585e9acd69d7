"""Put this folder on ``sys.path`` so that its helper modules (``rank_launch``) import by name (the
repository runs pytest with ``--import-mode=importlib``, which does not add test folders); the tiny
test model and its checkpoint weights, one per test module."""

import sys
from pathlib import Path

import pytest
import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rltrain.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="module")
def weights(model_dir) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    from megatron_bridge.vllm_names import grouped_order

    return grouped_order(load_file(str(model_dir / "model.safetensors")).items())
