"""The restart loop and preemption over fake roles, through the real ``run_driver``, checkpoints and
metrics file: a worker that dies (or stops answering) restarts the roles and the run resumes from
its last checkpoint (or step 0, the data position rewound) with the metrics of an uninterrupted run;
restarts are counted against ``trainer.max_restarts``; a stop signal saves the step and raises
``Preempted``; ``run_and_report`` turns each ending into one line and an exit code."""

import json
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rltrain.config import load_config
from rltrain.errors import DivergenceError
from rltrain.orchestrator import entry
from rltrain.orchestrator.worker_group import WorkerDied, WorkerTimeout
from rltrain.trainer import run as trainer_run
from rltrain.trainer.driver import PPOTrainer, Roles
from rltrain.trainer.preemption import PREEMPTED_EXIT_CODE, Preempted, StopSignals
from rltrain.trainer.recovery import RECOVER_SECONDS, RESTARTS

RECIPE = "recipes/quickstart_cpu.yaml"


@dataclass
class FakeLoader:
    """The data position: each batch is its index in the run."""

    position: int = 0
    batch_size: int = 1

    def next_batch(self) -> int:
        self.position += 1
        return self.position

    def state_dict(self) -> dict:
        return {"position": self.position, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


@dataclass
class FakeData:
    train: FakeLoader = field(default_factory=FakeLoader)
    val: None = None
    num_filtered: int = 0


@dataclass
class FakePolicy:
    """Saves and loads ``<root>/policy/step``; its worker is lost (``fail``) at step ``fail_at``."""

    fail_at: int = 0
    fail: type = WorkerDied
    on_save: object = None
    loads: list[str] = field(default_factory=list)

    def sync_weights(self, step: int) -> dict:
        return {}

    def step(self, step: int) -> None:
        if step == self.fail_at:
            if self.fail is WorkerTimeout:
                raise WorkerTimeout("critic", [0], "update_critic", seconds=5.0, key="update_s")
            if self.fail is WorkerDied:
                raise WorkerDied("actor_rollout_ref", 0, "generate", RuntimeError("ActorDiedError: gone"))
            raise self.fail("actor diverged: a parameter is not finite")

    def save(self, root: str, step: int) -> None:
        (Path(root) / "policy").mkdir()
        (Path(root) / "policy" / "step").write_text(str(step))
        if self.on_save is not None:
            self.on_save()

    def load(self, root: str) -> int:
        self.loads.append(Path(root).name)
        return int((Path(root) / "policy" / "step").read_text())


def fake_train_step(self: PPOTrainer, step: int) -> dict[str, float]:
    """Metrics that depend on the step, the data position and the KL controller, like a real step."""
    batch = self.data.train.next_batch()
    self.roles.policy.step(step)
    self.kl_ctrl.value += 0.5
    return {"value": 100.0 * step + batch + self.kl_ctrl.value, "timing_s/step": 0.1}


@pytest.fixture(autouse=True)
def fake_steps(monkeypatch):
    monkeypatch.setattr(PPOTrainer, "train_step", fake_train_step)


def config_in(tmp_path, *extra):
    return load_config(
        RECIPE,
        [
            f"trainer.default_local_dir={tmp_path}",
            "trainer.total_training_steps=4",
            "critic.warmup_steps=0",
            "trainer.test_freq=0",
            "trainer.logger=[jsonl]",
            *extra,
        ],
    )


def records(config) -> dict[int, dict]:
    lines = (config.run_dir() / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["step"] > 0}


def run(config, policy, *, replacements=(), stop=None):
    """``run_driver`` over ``policy``; each restart takes the next of ``replacements``."""
    setup = trainer_run.RunSetup(model_dir="", tokenizer=None, data=FakeData(), total_steps=4)
    spares = iter(replacements)
    return trainer_run.run_driver(
        config,
        setup,
        Roles(policy=policy, critic=None),
        stop=stop,
        restart_roles=lambda: Roles(policy=next(spares), critic=None),
    )


def uninterrupted(tmp_path, *extra) -> dict[int, dict]:
    config = config_in(tmp_path / "reference", *extra)
    assert run(config, FakePolicy()) == 4
    return records(config)


def same_metrics(got: dict[int, dict], want: dict[int, dict]) -> None:
    assert sorted(got) == sorted(want)
    for step, record in want.items():
        assert {k: v for k, v in got[step].items() if not k.startswith("trainer/")} == record, step


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rltrain.trainer.recovery"]


def test_a_dead_worker_restarts_the_roles_and_resumes_from_the_last_checkpoint(tmp_path, caplog):
    want = uninterrupted(tmp_path, "trainer.save_freq=2")
    config = config_in(tmp_path / "recovered", "trainer.save_freq=2", "trainer.max_restarts=1")
    spare = FakePolicy()
    caplog.set_level(logging.INFO)
    assert run(config, FakePolicy(fail_at=3), replacements=[spare]) == 4
    got = records(config)
    same_metrics(got, want)
    assert spare.loads == ["step_2"]
    assert got[3][RESTARTS] == 1 and 0 <= got[3][RECOVER_SECONDS] < 5
    assert RESTARTS not in got[4]
    assert warnings_of(caplog) == [
        "actor_rollout_ref rank 0 (generate): the worker process died (RuntimeError): restarting every "
        "worker group and resuming from the last good checkpoint (restart 1 of 1, trainer.max_restarts)",
        f"restart 1 of 1: resumed from step 2, {got[3][RECOVER_SECONDS]:.1f} s after the failure",
    ]


def test_before_any_checkpoint_the_run_starts_again_from_step_0(tmp_path, caplog):
    want = uninterrupted(tmp_path, "trainer.save_freq=2")
    config = config_in(tmp_path / "recovered", "trainer.save_freq=2", "trainer.max_restarts=1")
    caplog.set_level(logging.INFO)
    assert run(config, FakePolicy(fail_at=2), replacements=[FakePolicy()]) == 4
    same_metrics(records(config), want)  # the data position and the KL controller started over too
    assert warnings_of(caplog)[1].startswith("restart 1 of 1: no checkpoint yet: started again from step 0, ")


def test_a_worker_lost_while_the_workers_start_is_recovered_too(tmp_path, caplog):
    want = uninterrupted(tmp_path, "trainer.save_freq=2")
    config = config_in(tmp_path / "recovered", "trainer.save_freq=2", "trainer.max_restarts=1")

    def start_dies():
        raise WorkerDied("critic", 0, "rank_info", RuntimeError("gone"))

    setup = trainer_run.RunSetup(model_dir="", tokenizer=None, data=FakeData(), total_steps=4)
    caplog.set_level(logging.INFO)
    restarted = lambda: Roles(policy=FakePolicy(), critic=None)  # noqa: E731
    assert trainer_run.run_driver(config, setup, start_dies, restart_roles=restarted) == 4
    same_metrics(records(config), want)
    assert warnings_of(caplog)[0].startswith(
        "critic rank 0 (rank_info): the worker process died (RuntimeError)"
    )
    with pytest.raises(WorkerDied):  # without restarts it stops the run as it came
        trainer_run.run_driver(config_in(tmp_path / "stopped"), setup, start_dies, restart_roles=restarted)


def test_restarts_are_counted_against_max_restarts(tmp_path):
    want = uninterrupted(tmp_path, "trainer.save_freq=1")
    config = config_in(tmp_path / "twice", "trainer.save_freq=1", "trainer.max_restarts=2")
    spares = [FakePolicy(fail_at=3, fail=WorkerTimeout), FakePolicy()]
    assert run(config, FakePolicy(fail_at=2), replacements=spares) == 4
    got = records(config)
    same_metrics(got, want)
    assert (got[2][RESTARTS], got[3][RESTARTS]) == (1, 2)

    config = config_in(tmp_path / "too_many", "trainer.save_freq=1", "trainer.max_restarts=1")
    spares = [FakePolicy(fail_at=3, fail=WorkerTimeout)]
    with pytest.raises(WorkerTimeout, match=r"^critic rank 0: update_critic did not finish within 5 s"):
        run(config, FakePolicy(fail_at=2), replacements=spares)


def test_without_max_restarts_or_for_another_error_the_run_stops(tmp_path):
    with pytest.raises(
        WorkerDied, match=r"^actor_rollout_ref rank 0: generate failed: the worker process died"
    ):
        run(config_in(tmp_path / "a"), FakePolicy(fail_at=2), replacements=[FakePolicy()])
    config = config_in(tmp_path / "b", "trainer.max_restarts=3")
    with pytest.raises(DivergenceError):
        run(config, FakePolicy(fail_at=2, fail=DivergenceError), replacements=[FakePolicy()])


def test_a_stop_signal_saves_the_step_and_the_resumed_run_repeats_the_rest(tmp_path, caplog):
    want = uninterrupted(tmp_path, "trainer.save_freq=0")
    config = config_in(tmp_path / "preempted", "trainer.save_freq=0")

    class SignalledAtStep2(FakePolicy):
        def step(self, step: int) -> None:
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    # a second signal arrives during the save: the save completes, nothing else happens
    policy = SignalledAtStep2(on_save=lambda: os.kill(os.getpid(), signal.SIGUSR1))
    caplog.set_level(logging.INFO)
    previous = signal.getsignal(signal.SIGTERM)
    with StopSignals().installed() as stop, pytest.raises(Preempted) as info:
        run(config, policy, stop=stop)
    assert signal.getsignal(signal.SIGTERM) is previous
    ckpt = config.run_dir() / "checkpoints"
    assert str(info.value) == f"stopped by SIGTERM after step 2; its checkpoint is {ckpt / 'step_2'}"
    assert (info.value.step, stop.count) == (2, 2)
    assert (ckpt / "latest").read_text().strip() == "step_2"
    assert sorted(records(config)) == [1, 2]
    assert "SIGTERM received: saving a checkpoint at this step's end, then stopping" in caplog.text
    resumed = FakePolicy()
    assert run(config, resumed) == 4
    assert resumed.loads == ["step_2"]
    same_metrics(records(config), want)


def test_a_stop_before_the_first_step_saves_nothing(tmp_path):
    config = config_in(tmp_path, "trainer.save_freq=0")
    stop = StopSignals()
    stop.signum, stop.count = signal.SIGUSR1, 1
    with pytest.raises(
        Preempted, match=r"^stopped by SIGUSR1 after step 0; no checkpoint yet: a resume starts"
    ):
        run(config, FakePolicy(), stop=stop)
    assert not (config.run_dir() / "checkpoints").exists()


def test_a_stop_at_the_last_step_just_finishes(tmp_path):
    config = config_in(tmp_path, "trainer.save_freq=0")

    class SignalledAtStep4(FakePolicy):
        def step(self, step: int) -> None:
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)

    with StopSignals().installed() as stop:
        assert run(config, SignalledAtStep4(), stop=stop) == 4
    assert not (config.run_dir() / "checkpoints").exists()


@pytest.mark.parametrize(
    ("raised", "code", "line"),
    [
        (
            Preempted(signal_name="SIGUSR1", step=3, checkpoint=Path("/r/checkpoints/step_3")),
            PREEMPTED_EXIT_CODE,
            "prog: stopped by SIGUSR1 after step 3; its checkpoint is /r/checkpoints/step_3; "
            "resume with: rltrain train r.yaml a=1",
        ),
        (
            WorkerDied("critic", 1, "update_critic", RuntimeError("ray says\nmany lines")),
            1,
            "prog: critic rank 1: update_critic failed: the worker process died (RuntimeError) "
            "(details in {log})",
        ),
        (DivergenceError("actor diverged: x"), 1, "prog: actor diverged: x"),
    ],
)
def test_run_and_report_ends_in_one_line_and_an_exit_code(tmp_path, monkeypatch, capsys, raised, code, line):
    from rltrain.train import run_and_report

    def train(config):
        raise raised

    monkeypatch.setattr(entry, "train", train)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = config_in(tmp_path)
    assert run_and_report("prog", config, resume_command="rltrain train r.yaml a=1") == code
    printed = capsys.readouterr().err
    assert printed == line.format(log=config.run_dir() / "rltrain.log") + "\n"


def test_the_resume_line_turns_a_fresh_start_into_a_resume(tmp_path):
    from rltrain.train import _resume_overrides

    assert _resume_overrides(config_in(tmp_path)) == ""
    fresh = config_in(tmp_path, "trainer.resume_mode=disable", "trainer.checkpoint.discard_existing=true")
    assert _resume_overrides(fresh) == " trainer.resume_mode=auto trainer.checkpoint.discard_existing=false"
