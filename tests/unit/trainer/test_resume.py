"""The driver's resume over fake roles: a checkpoint a worker fails to load is passed over in one line,
the previous one loads into every role and the driver; ``resume_mode: disable`` over checkpoints."""

import logging
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rltrain.config import ConfigError, load_config
from rltrain.data.loader import PromptLoader
from rltrain.data.prompt_rows import PromptExample
from rltrain.trainer.checkpoints import CheckpointError
from rltrain.trainer.driver import PPOTrainer, Roles
from rltrain.trainer.recovery import WorkerError

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


def prompts(n: int) -> list[PromptExample]:
    return [
        PromptExample(
            index=i, prompt=f"p{i}", ground_truth=str(i), data_source="t", extra_info={}, origin=f"f:{i}"
        )
        for i in range(n)
    ]


@dataclass
class FakeData:
    """The run's data as the driver sees it, over a real loader (40 prompts, batches of 4)."""

    train: PromptLoader = field(default_factory=lambda: PromptLoader(prompts(40), 4, seed=0))


def trainer_for(tmp_path, *overrides, critic_broken=(), data=None):
    config = load_config(RECIPE, [f"trainer.default_local_dir={tmp_path}", *overrides])
    roles = Roles(policy=FakeRole("actor"), critic=FakeRole("critic", broken=set(critic_broken)))
    return PPOTrainer(
        config,
        roles=roles,
        tokenizer=None,
        data=data or FakeData(),
        rewards=None,
        tracker=None,
        total_steps=4,
    )


def test_a_checkpoint_a_worker_cannot_load_falls_back_to_the_previous_one(tmp_path, caplog):
    writer = trainer_for(tmp_path)
    saved = {}
    for step in (2, 4):
        writer.data.train.next_batch()
        saved[step] = writer.data.train.state_dict()
        writer.kl_ctrl.value = 0.01 * step
        writer.save(step)
    trainer = trainer_for(tmp_path, critic_broken={4})
    caplog.set_level(logging.INFO)
    assert trainer.resume() == 2
    assert trainer.roles.policy.loads == ["step_4", "step_2"] == trainer.roles.critic.loads
    assert trainer.data.train.state_dict() == saved[2] and saved[2] != saved[4]
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


def test_a_new_batch_size_resumes_at_the_same_prompt_and_says_so(tmp_path, caplog):
    """``data.train_batch_size`` 4 -> 6 between a save and the resume: the next batch starts at the prompt
    the save stopped at (the 12th of epoch 0's order), six prompts long."""
    writer = trainer_for(tmp_path)
    for _ in range(3):
        writer.data.train.next_batch()
    writer.save(3)
    resized = FakeData(train=PromptLoader(prompts(40), 6, seed=0))
    trainer = trainer_for(tmp_path, data=resized)
    caplog.set_level(logging.INFO)
    assert trainer.resume() == 3
    order = resized.train.epoch_order(0)
    assert resized.train.next_batch().indices == order[12:18]
    assert (
        "the data batch size was 4 when step_3 was saved and is 6 now: resuming at prompt 12 of epoch 0's "
        "order in batches of 6"
    ) in caplog.text


def test_another_data_order_is_refused_in_one_line_before_any_role_loads(tmp_path):
    writer = trainer_for(tmp_path)
    writer.data.train.next_batch()
    writer.save(1)
    other_seed = FakeData(train=PromptLoader(prompts(40), 4, seed=1))
    trainer = trainer_for(tmp_path, data=other_seed)
    with pytest.raises(CheckpointError) as err:
        trainer.resume()
    assert str(err.value) == (
        f"cannot resume from {trainer.checkpoints.root / 'step_1'}: the data order was saved with data.seed=0, "
        "this run has data.seed=1; resume with the saved setting or start a new run (trainer.experiment_name=...)"
    )
    assert trainer.roles.policy.loads == [] == trainer.roles.critic.loads


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
