"""A full filesystem for real: the run's ``checkpoints/`` is a tmpfs (mounted by the test: root needed)
with room for three checkpoints, two of them taken by other data. ``step_1`` fits; the save of
``step_2`` hits ENOSPC inside the actor's Megatron writer: the run stops with one line naming the
path, the writer's error, the free space (less than ``step_1`` takes) and that ``latest`` still
names ``step_1``, and leaves no partial directory.
Once the other data is gone, the same run resumes from ``step_1`` to the uninterrupted metrics."""

import math
import re
import subprocess

import pytest
from fault_runs import RECIPE, STEPS, assert_same_metrics, fault_overrides, metrics_of

from rltrain.config import load_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGE = 4096


def tmpfs_bytes(directory) -> int:
    """What ``directory``'s files take on a tmpfs (whole pages)."""
    return sum(math.ceil(p.stat().st_size / PAGE) * PAGE for p in directory.rglob("*") if p.is_file())


def test_a_full_disk_stops_the_save_in_one_line_and_the_run_resumes_once_space_is_back(
    fault_ray, fault_cache, reference, tmp_path, capsys
):
    from rltrain.orchestrator.entry import train
    from rltrain.train import run_and_report

    config = load_config(RECIPE, fault_overrides(tmp_path, fault_cache))
    ckpt = config.run_dir() / "checkpoints"
    ckpt.mkdir(parents=True)
    one = tmpfs_bytes(reference.run_dir / "checkpoints" / "step_1")
    size_kib = math.ceil(3.5 * one / 1024)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(ckpt)],
        capture_output=True,
        text=True,
    )
    assert mounted.returncode == 0, f"this test mounts a tmpfs (needs root): {mounted.stderr}"
    try:
        other_data = ckpt / "other-data.bin"
        other_data.write_bytes(b"\0" * (2 * one))
        assert run_and_report("rltrain train", config, resume_command="rltrain train ...") == 1
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith(
            f"rltrain train: checkpoint step_2 could not be saved in {ckpt / '.tmp-step_2'}: "
        )
        # torch's writer reports the short write of a full disk as an "unexpected pos" in the file
        assert "No space left on device" in line or "unexpected pos" in line, line
        assert re.search(r"\(\d+\.\d [KM]iB free there, less than step_1 takes \(\d+\.\d MiB\)\); ", line), (
            line
        )
        assert line.endswith(f"; {ckpt / 'latest'} still names step_1"), line
        assert (ckpt / "latest").read_text().strip() == "step_1"
        assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "other-data.bin", "step_1"]
        print(f"the one line: {line}")

        other_data.unlink()
        assert train(config) == STEPS
        assert (ckpt / "latest").read_text().strip() == f"step_{STEPS}"
        assert_same_metrics(metrics_of(config.run_dir()), reference.metrics, range(1, STEPS + 1))
    finally:
        subprocess.run(["umount", str(ckpt)], check=False)
