"""The driver's resume over fake roles: a checkpoint a worker fails to load is passed over in one line,
the previous one loads into every role and the driver; ``resume_mode: disable`` over checkpoints."""

import logging
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rltrain.config import ConfigError, load_config
from rltrain.orchestrator.checkpoints import CheckpointError
from rltrain.orchestrator.driver import PPOTrainer, Roles
from rltrain.orchestrator.worker_group import WorkerError

RECIPE = "recipes/quickstart_cpu.yaml"


@dataclass
class FakeRole:
    """A role handle whose workers save ``<root>/<name>/step`` and fail to load the steps in ``broken``."""

    name: str
    broken: set[int] = field(default_factory=set)
    loads: list[str] = field(default_factory=list)

    def save(self, root: str, step: int) -> None:
        (Path(root) / self.name).mkdir()
        (Path(root) / self.name / "step").write_text(str(step))

    def load(self, root: str) -> int:
        self.loads.append(Path(root).name)
        step = int((Path(root) / self.name / "step").read_text())
        if step in self.broken:
            detail = "EOFError: Ran out of input\n--- worker traceback ---\nTraceback ..."
            raise WorkerError(self.name, 1, "load_checkpoint", detail)
        return step


@dataclass
class FakeLoader:
    position: int = 0
    loaded: list[dict] = field(default_factory=list)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(state)


@dataclass
class FakeData:
    train: FakeLoader = field(default_factory=FakeLoader)


def trainer_for(tmp_path, *overrides, critic_broken=()):
    config = load_config(RECIPE, [f"trainer.default_local_dir={tmp_path}", *overrides])
    roles = Roles(policy=FakeRole("actor"), critic=FakeRole("critic", broken=set(critic_broken)))
    return PPOTrainer(
        config, roles=roles, tokenizer=None, data=FakeData(), rewards=None, tracker=None, total_steps=4
    )


def test_a_checkpoint_a_worker_cannot_load_falls_back_to_the_previous_one(tmp_path, caplog):
    writer = trainer_for(tmp_path)
    for step in (2, 4):
        writer.data.train.position = step * 10
        writer.kl_ctrl.value = 0.01 * step
        writer.save(step)
    trainer = trainer_for(tmp_path, critic_broken={4})
    caplog.set_level(logging.INFO)
    assert trainer.resume() == 2
    assert trainer.roles.policy.loads == ["step_4", "step_2"] == trainer.roles.critic.loads
    assert trainer.data.train.loaded == [{"position": 20}]
    assert trainer.kl_ctrl.value == pytest.approx(0.02)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"cannot resume from {trainer.checkpoints.root / 'step_4'}: critic rank 1: load_checkpoint failed: "
        "EOFError: Ran out of input; falling back to step_2"
    ]
    assert f"resumed from {trainer.checkpoints.root / 'step_2'} (step 2)" in caplog.text


def test_when_no_checkpoint_loads_the_run_stops_naming_each(tmp_path):
    writer = trainer_for(tmp_path)
    for step in (2, 4):
        writer.save(step)
    with pytest.raises(CheckpointError, match=r"step_4: critic rank 1: .*EOFError.*; step_2: critic rank 1"):
        trainer_for(tmp_path, critic_broken={2, 4}).resume()


def test_resume_mode_disable_over_checkpoints_needs_an_explicit_choice(tmp_path):
    trainer_for(tmp_path).save(2)
    root = trainer_for(tmp_path).checkpoints.root
    with pytest.raises(
        CheckpointError, match=rf"^trainer\.resume_mode=disable, but {root} holds checkpoints \(step_2\)"
    ):
        trainer_for(tmp_path, "trainer.resume_mode=disable").resume()
    assert (root / "step_2").is_dir()
    fresh = trainer_for(tmp_path, "trainer.resume_mode=disable", "trainer.checkpoint.discard_existing=true")
    assert fresh.resume() == 0
    assert list(root.iterdir()) == []
    assert fresh.roles.policy.loads == []


def test_discard_existing_without_resume_mode_disable_is_refused(tmp_path):
    with pytest.raises(
        ConfigError, match=r"trainer\.checkpoint\.discard_existing=true needs trainer\.resume_mode=disable"
    ):
        load_config(
            RECIPE, [f"trainer.default_local_dir={tmp_path}", "trainer.checkpoint.discard_existing=true"]
        )
