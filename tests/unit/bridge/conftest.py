"""Tiny HF checkpoints of every bridged family, saved once per test session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_bridge.registry import family_types
from rltrain.models.tiny import save_tiny_model

FAMILIES = tuple(family_types())


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_hf")
    return {mt: save_tiny_model(root / mt, mt, seed=3) for mt in FAMILIES}


@pytest.fixture(scope="session")
def tiny_states(tiny_checkpoints) -> dict[str, tuple[dict, dict]]:
    """model_type -> (config dict, state dict with HF checkpoint names)."""
    return {
        mt: (json.loads((p / "config.json").read_text()), load_file(p / "model.safetensors"))
        for mt, p in tiny_checkpoints.items()
    }
