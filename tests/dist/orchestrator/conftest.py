"""Make this folder's rank functions and the Megatron tests' launcher (``tests/dist/megatron``:
``dist_harness.run_ranks``) importable by name, also in spawned rank processes (which inherit
``sys.path``; the repository runs pytest with ``--import-mode=importlib``); the tiny test model."""

import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
for _folder in (_HERE, _HERE.parent / "megatron"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rltrain.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")
