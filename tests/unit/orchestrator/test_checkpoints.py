"""Run checkpoints: complete or absent, latest marker last, pruning, interrupted saves ignored."""

import json

import pytest

from rltrain.orchestrator.checkpoints import RunCheckpoints


def write_roles(path):
    (path / "actor").mkdir()
    (path / "actor" / "weights").write_text("w")


def test_save_then_latest_and_state(tmp_path):
    ckpt = RunCheckpoints(tmp_path, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, write_roles=write_roles, state={"step": step, "kl_ctrl": {"value": 0.1 * step}})
    assert ckpt.latest() == tmp_path / "step_3"
    assert RunCheckpoints.read_state(tmp_path / "step_3")["kl_ctrl"]["value"] == pytest.approx(0.3)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2", "step_3"]


def test_save_killed_mid_write_leaves_previous_checkpoint(tmp_path, caplog):
    ckpt = RunCheckpoints(tmp_path, keep=None)
    ckpt.save(1, write_roles=write_roles, state={"step": 1})

    def crash(path):
        write_roles(path)
        raise KeyboardInterrupt("killed while writing the critic")

    with pytest.raises(KeyboardInterrupt):
        ckpt.save(2, write_roles=crash, state={"step": 2})
    assert (tmp_path / ".tmp-step_2").exists() and not (tmp_path / "step_2").exists()
    assert ckpt.latest() == tmp_path / "step_1"
    assert "ignoring" in caplog.text and ".tmp-step_2" in caplog.text
    assert json.loads((tmp_path / "step_1" / "driver_state.json").read_text()) == {"step": 1}


def test_marker_naming_incomplete_checkpoint_fails_loudly(tmp_path):
    (tmp_path / "latest").write_text("step_9\n")
    with pytest.raises(FileNotFoundError, match="step_9, which is not a complete checkpoint"):
        RunCheckpoints(tmp_path, keep=None).latest()
    with pytest.raises(FileNotFoundError, match=r"trainer\.resume_from_path"):
        RunCheckpoints(tmp_path, keep=None).resume_path(str(tmp_path / "nope"))
