"""Run checkpoints: complete or absent, manifest before latest, pruning, interrupted saves ignored,
damaged checkpoints passed over in one line each, failed saves that leave latest where it was."""

import errno
import json
import logging
import re

import pytest

from rltrain.trainer import checkpoints as ckpt_mod
from rltrain.trainer.checkpoints import CheckpointError, CheckpointLoadError, RunCheckpoints
from rltrain.trainer.manifest import MANIFEST, verify_manifest

SHARD = "actor/step_{n}/__0_0.distcp"


def write_roles(path):
    """A role checkpoint shaped like Megatron's: ``actor/latest`` and a shard under ``actor/step_<n>``."""
    n = int(path.name.removeprefix(".tmp-step_"))
    (path / "actor" / f"step_{n}").mkdir(parents=True)
    (path / "actor" / "latest").write_text(f"step_{n}")
    (path / SHARD.format(n=n)).write_bytes(bytes([n]) * 4096)


def saved(tmp_path, steps=(1, 2, 3), keep=None):
    ckpt = RunCheckpoints(tmp_path, keep=keep)
    for step in steps:
        ckpt.save(step, write_roles=write_roles, state={"step": step, "kl_ctrl": {"value": 0.1 * step}})
    return ckpt


def resumed(ckpt, **kwargs):
    """(the step a resume takes, the paths it tried to load in order)."""
    tried = []

    def load(path):
        tried.append(path.name)
        return RunCheckpoints.read_state(path)["step"]

    return ckpt.resume(load, **kwargs), tried


def one_line_warnings(caplog):
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert all("\n" not in line for line in lines), lines
    return lines


def test_save_then_latest_manifest_and_state(tmp_path):
    ckpt = saved(tmp_path, keep=2)
    assert (tmp_path / "latest").read_text() == "step_3\n"
    assert RunCheckpoints.read_state(tmp_path / "step_3")["kl_ctrl"]["value"] == pytest.approx(0.3)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2", "step_3"]
    listed = json.loads((tmp_path / "step_3" / MANIFEST).read_text())["files"]
    assert sorted(listed) == ["actor/latest", SHARD.format(n=3), "driver_state.json"]
    assert listed[SHARD.format(n=3)]["size"] == 4096
    assert resumed(ckpt) == (3, ["step_3"])


def test_manifest_is_written_before_latest_moves(tmp_path, monkeypatch):
    ckpt = saved(tmp_path, steps=(1,))
    seen = []
    real_replace = ckpt_mod.os.replace

    def replace(src, dst):
        if str(dst).endswith("latest"):
            seen.append(verify_manifest(tmp_path / "step_2").ok)
        real_replace(src, dst)

    monkeypatch.setattr(ckpt_mod.os, "replace", replace)
    ckpt.save(2, write_roles=write_roles, state={"step": 2})
    assert seen == [True]


def test_save_killed_mid_write_leaves_previous_checkpoint(tmp_path, caplog):
    ckpt = saved(tmp_path, steps=(1,))

    def crash(path):
        write_roles(path)
        raise KeyboardInterrupt("killed while writing the critic")

    with pytest.raises(KeyboardInterrupt):
        ckpt.save(2, write_roles=crash, state={"step": 2})
    assert (tmp_path / ".tmp-step_2").exists() and not (tmp_path / "step_2").exists()
    assert resumed(ckpt) == (1, ["step_1"])
    assert "ignoring" in caplog.text and ".tmp-step_2" in caplog.text
    assert json.loads((tmp_path / "step_1" / "driver_state.json").read_text()) == {
        "step": 1,
        "kl_ctrl": {"value": 0.1},
    }


def truncate_shard(root):
    shard = root / "step_3" / SHARD.format(n=3)
    shard.write_bytes(shard.read_bytes()[:100])
    return shard, "has 100 bytes, the manifest says 4096 (truncated)"


def zero_fill_shard_at(root, n):
    shard = root / f"step_{n}" / SHARD.format(n=n)
    shard.write_bytes(bytes(4096))  # the same size, other bytes
    return shard, "its bytes differ from the saved ones"


def zero_fill_shard(root):
    return zero_fill_shard_at(root, 3)


def garble_driver_state(root):
    state = root / "step_3" / "driver_state.json"
    state.write_bytes(b"\xff\xfe" + state.read_bytes()[2:])
    return state, "its bytes differ from the saved ones"


@pytest.mark.parametrize("damage", [truncate_shard, zero_fill_shard, garble_driver_state])
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_resumed(tmp_path, caplog, damage):
    ckpt = saved(tmp_path)
    culprit, why = damage(tmp_path)
    assert resumed(ckpt) == (2, ["step_2"])
    (line,) = one_line_warnings(caplog)
    assert line.startswith(f"cannot resume from {tmp_path / 'step_3'}: {culprit}")
    assert why in line and line.endswith("; falling back to step_2")


@pytest.mark.parametrize(
    ("marker", "said"), [(None, "is missing"), (b"\x00\x00\x00", "is damaged (it holds b'\\x00\\x00\\x00'")]
)
def test_missing_or_garbled_latest_takes_the_newest_checkpoint_that_verifies(tmp_path, caplog, marker, said):
    ckpt = saved(tmp_path)
    if marker is None:
        (tmp_path / "latest").unlink()
    else:
        (tmp_path / "latest").write_bytes(marker)
    assert resumed(ckpt) == (3, ["step_3"]), "never silently from step 0"
    (line,) = one_line_warnings(caplog)
    assert line.startswith(f"{tmp_path / 'latest'} {said}")
    assert line.endswith(": resuming from the newest checkpoint that verifies")


def test_latest_naming_a_checkpoint_that_is_gone(tmp_path, caplog):
    ckpt = saved(tmp_path, steps=(1,))
    (tmp_path / "latest").write_text("step_9\n")
    assert resumed(ckpt) == (1, ["step_1"])
    assert one_line_warnings(caplog) == [
        f"{tmp_path / 'latest'} names step_9, which does not exist: "
        "resuming from the newest checkpoint that verifies"
    ]
    for step_dir in tmp_path.glob("step_*"):
        ckpt_mod.shutil.rmtree(step_dir)
    with pytest.raises(CheckpointError, match=r"names step_9, but .* holds no checkpoint"):
        resumed(ckpt)


def test_a_checkpoint_newer_than_latest_is_ignored_and_said(tmp_path, caplog):
    ckpt = saved(tmp_path)
    (tmp_path / "latest").write_text("step_2\n")  # killed between the rename and moving latest
    assert resumed(ckpt) == (2, ["step_2"])
    assert one_line_warnings(caplog) == [
        f"ignoring {tmp_path / 'step_3'}: newer than step_2, which {tmp_path / 'latest'} names"
    ]


def test_a_checkpoint_the_roles_fail_to_load_falls_back_to_the_previous_one(tmp_path, caplog):
    ckpt = saved(tmp_path)
    tried = []

    def load(path):
        tried.append(path.name)
        if path.name == "step_3":
            raise CheckpointLoadError("critic rank 1: load_checkpoint failed: KeyError: 'decoder.layers.0'")
        return RunCheckpoints.read_state(path)["step"]

    assert ckpt.resume(load) == 2 and tried == ["step_3", "step_2"]
    assert one_line_warnings(caplog) == [
        f"cannot resume from {tmp_path / 'step_3'}: critic rank 1: load_checkpoint failed: "
        "KeyError: 'decoder.layers.0'; falling back to step_2"
    ]


def test_when_none_verifies_the_run_stops_naming_every_file(tmp_path):
    ckpt = saved(tmp_path, steps=(2, 3))
    truncate_shard(tmp_path)
    (tmp_path / "step_2" / "driver_state.json").write_text("{}")
    with pytest.raises(CheckpointError) as err:
        resumed(ckpt)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"no checkpoint in {tmp_path} can be resumed from: step_3: ")
    assert str(tmp_path / "step_3" / SHARD.format(n=3)) in message
    assert f"step_2: {tmp_path / 'step_2' / 'driver_state.json'} has 2 bytes" in message


def test_resume_from_path_must_verify(tmp_path):
    ckpt = saved(tmp_path, steps=(1, 2))
    assert resumed(ckpt, explicit=str(tmp_path / "step_1")) == (1, ["step_1"])
    with pytest.raises(
        CheckpointError, match=r"trainer\.resume_from_path=.*nope: .*manifest\.json is missing"
    ):
        resumed(ckpt, explicit=str(tmp_path / "nope"))


def test_a_fresh_start_over_checkpoints_needs_an_explicit_choice(tmp_path, caplog):
    ckpt = saved(tmp_path, steps=(1, 2))
    with pytest.raises(CheckpointError) as err:
        ckpt.start_fresh(discard_existing=False)
    assert str(err.value) == (
        f"trainer.resume_mode=disable, but {tmp_path} holds checkpoints (step_1, step_2): to start from "
        "step 0, use a new run directory (e.g. trainer.experiment_name=...) or set "
        "trainer.checkpoint.discard_existing=true, which deletes them"
    )
    assert (tmp_path / "step_2").is_dir()
    ckpt.start_fresh(discard_existing=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert "deleted step_1, step_2" in caplog.text
    RunCheckpoints(tmp_path / "empty", keep=None).start_fresh(discard_existing=False)


def test_a_resume_past_a_damaged_checkpoint_then_saves_over_it(tmp_path):
    ckpt = saved(tmp_path, keep=2)
    zero_fill_shard(tmp_path)
    assert resumed(ckpt) == (2, ["step_2"])
    ckpt.save(3, write_roles=write_roles, state={"step": 3})
    assert verify_manifest(tmp_path / "step_3").ok
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2", "step_3"]


# ---- failed saves ---------------------------------------------------------------------------------
def no_space(path):
    write_roles(path)
    raise OSError(errno.ENOSPC, "No space left on device", str(path / "critic" / "__0_0.distcp"))


def assert_failed_save_left_step_1(tmp_path, err, culprit):
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint step_2 could not be saved in {tmp_path / '.tmp-step_2'}: ")
    assert culprit in message and " free there" in message
    assert message.endswith(f"{tmp_path / 'latest'} still names step_1")
    assert (tmp_path / "latest").read_text() == "step_1\n"
    assert not (tmp_path / "step_2").exists() and not (tmp_path / ".tmp-step_2").is_dir()
    assert resumed(RunCheckpoints(tmp_path, keep=None)) == (1, ["step_1"])


def test_no_space_in_a_role_save_stops_with_one_line_naming_the_path(tmp_path):
    ckpt = saved(tmp_path, steps=(1,))
    with pytest.raises(CheckpointError) as err:
        ckpt.save(2, write_roles=no_space, state={"step": 2})
    assert_failed_save_left_step_1(tmp_path, err, ": no space left on the device (")
    step_1 = sum(p.stat().st_size for p in (tmp_path / "step_1").rglob("*") if p.is_file())
    assert f" free there, about {step_1 / 1024:.1f} KiB needed (the size of step_1)); " in str(err.value)
    assert isinstance(err.value.__cause__, OSError)


def test_no_space_before_any_checkpoint_names_what_was_written(tmp_path):
    def half_written(path):
        (path / "actor").mkdir(parents=True)
        (path / "actor" / "__0_0.distcp").write_bytes(b"x" * 3000)
        raise OSError(errno.ENOSPC, "No space left on device", str(path / "actor" / "__0_1.distcp"))

    with pytest.raises(CheckpointError) as err:
        RunCheckpoints(tmp_path, keep=None).save(1, write_roles=half_written, state={"step": 1})
    assert re.fullmatch(
        rf"checkpoint step_1 could not be saved in {re.escape(str(tmp_path / '.tmp-step_1'))}: no space left "
        r"on the device \(\d+\.\d [KMGT]iB free there, more than the 2\.9 KiB it had written needed\); "
        "no earlier checkpoint",
        str(err.value),
    ), str(err.value)


def test_a_worker_save_failure_names_the_innermost_error_and_a_disk_too_full(tmp_path, monkeypatch):
    """What a full disk looks like from a Megatron writer in a worker: a generic first line; the short
    write that started it is deep in the worker's traceback."""
    ckpt = saved(tmp_path, steps=(1,))
    worker_text = (
        "actor_rollout_ref rank 0: save_checkpoint failed: CheckpointException: CheckpointException "
        'ranks:dict_keys([0])\nTraceback (most recent call last): (RANK 0)\n  File "x.py", line 1\n'
        "RuntimeError: Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
        '\n\n--- worker traceback ---\nTraceback (most recent call last):\n  File "y.py", line 2\n'
        "torch.distributed.checkpoint.api.CheckpointException: CheckpointException ranks:dict_keys([0])"
    )

    def failing_worker(path):
        raise RuntimeError(worker_text)

    free = ckpt_mod.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(ckpt_mod.shutil, "disk_usage", lambda path: free._replace(free=2048))
    with pytest.raises(CheckpointError) as err:
        ckpt.save(2, write_roles=failing_worker, state={"step": 2})
    step_1_bytes = sum(p.stat().st_size for p in (tmp_path / "step_1").rglob("*") if p.is_file())
    assert str(err.value) == (
        f"checkpoint step_2 could not be saved in {tmp_path / '.tmp-step_2'}: no space left on the device "
        f"(2.0 KiB free there, about {step_1_bytes / 1024:.1f} KiB needed (the size of step_1)); "
        f"{tmp_path / 'latest'} still names step_1"
    )
    # the same short write with room to spare is not called a full disk: the writer's words stay
    monkeypatch.setattr(ckpt_mod.shutil, "disk_usage", lambda path: free._replace(free=1 << 40))
    with pytest.raises(CheckpointError) as err:
        ckpt.save(2, write_roles=failing_worker, state={"step": 2})
    assert str(err.value) == (
        f"checkpoint step_2 could not be saved in {tmp_path / '.tmp-step_2'}: RuntimeError: actor_rollout_ref "
        "rank 0: save_checkpoint failed: CheckpointException: CheckpointException ranks:dict_keys([0]), from "
        "RuntimeError: Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598 "
        f"(1.0 TiB free there); {tmp_path / 'latest'} still names step_1"
    )


def test_no_space_for_the_manifest_leaves_no_complete_looking_directory(tmp_path, monkeypatch):
    ckpt = saved(tmp_path, steps=(1,))

    def full(directory):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / MANIFEST))

    monkeypatch.setattr(ckpt_mod, "write_manifest", full)
    with pytest.raises(CheckpointError) as err:
        ckpt.save(2, write_roles=write_roles, state={"step": 2})
    assert_failed_save_left_step_1(tmp_path, err, ": no space left on the device (")


def test_latest_that_cannot_be_rewritten_undoes_the_rename(tmp_path):
    ckpt = saved(tmp_path, steps=(1,))
    (tmp_path / ".tmp-latest").mkdir()  # a directory where the marker's temporary file goes
    with pytest.raises(CheckpointError) as err:
        ckpt.save(2, write_roles=write_roles, state={"step": 2})
    assert_failed_save_left_step_1(
        tmp_path, err, f"IsADirectoryError: [Errno 21] Is a directory: '{tmp_path}/.tmp-latest'"
    )


def test_a_file_where_the_checkpoint_directory_goes(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    ckpt = RunCheckpoints(tmp_path / "run" / "checkpoints", keep=None)
    with pytest.raises(CheckpointError) as err:
        ckpt.save(1, write_roles=write_roles, state={"step": 1})
    assert str(err.value).startswith(
        f"checkpoint step_1 could not be saved in {tmp_path}/run/checkpoints/.tmp-step_1: "
    )
    assert f"'{tmp_path}/run/checkpoints'" in str(err.value)
    assert str(err.value).endswith("; no earlier checkpoint")


# ---- rltrain checkpoint verify ------------------------------------------------------------------------
def test_verify_cli_on_a_good_and_a_damaged_run_dir(tmp_path, capsys):
    from rltrain.cli import main

    root = tmp_path / "run" / "checkpoints"
    saved(root, steps=(1, 2))
    assert main(["checkpoint", "verify", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{root / 'step_1'}: ok (3 files, 4.1 KiB)",
        f"{root / 'step_2'}: ok (3 files, 4.1 KiB)",
        f"{root / 'latest'}: names step_2",
        "a resume would start from step_2",
    ]
    shard, why = zero_fill_shard_at(root, 2)
    assert main(["checkpoint", "verify", str(root)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith(f"{root / 'step_2'}: FAILED: {shard}: {why}")
    assert out[-1] == "a resume would start from step_1"
    assert main(["checkpoint", "verify", str(root / "step_1")]) == 0
    assert main(["checkpoint", "verify", str(tmp_path / "nothing")]) == 1
    assert capsys.readouterr().err.strip().endswith(f"{tmp_path / 'nothing'}: no checkpoints there")
