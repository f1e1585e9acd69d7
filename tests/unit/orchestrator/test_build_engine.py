"""``build_engine`` picks the engine class by ``rollout.uses_async_engine()`` (engines stood in for)."""

from pathlib import Path

import pytest

from rltrain.config import load_config
from rltrain.orchestrator.workers import build_engine

REPO_ROOT = Path(__file__).resolve().parents[3]


class _Recorded:
    def __init__(self, model_path, *, settings):
        self.model_path, self.settings = model_path, settings


@pytest.mark.parametrize(("overrides", "expected"), [([], "offline"), (["rollout.engine=async"], "async")])
def test_build_engine_picks_the_configured_engine(tmp_path, monkeypatch, overrides, expected):
    classes = {"offline": type("Offline", (_Recorded,), {}), "async": type("Async", (_Recorded,), {})}
    monkeypatch.setattr("rltrain.rollout.engine.RolloutEngine", classes["offline"])
    monkeypatch.setattr("rltrain.rollout.async_engine.AsyncRolloutEngine", classes["async"])
    config = load_config(
        REPO_ROOT / "recipes/quickstart_cpu.yaml", [f"trainer.default_local_dir={tmp_path}", *overrides]
    )
    assert config.rollout.uses_async_engine() == (expected == "async")
    engine = build_engine(config, "/models/tiny")
    assert type(engine) is classes[expected] and engine.model_path == "/models/tiny"
    expected_len = config.rollout.max_model_len or (
        config.data.max_prompt_length + config.rollout.response_length
    )
    assert engine.settings.max_model_len == expected_len
    assert engine.settings.dtype == config.model.dtype
    assert engine.settings.seed == config.rollout.seed
