"""Preemption and a full disk for real, in the chain a preempted job may meet.

``rltrain train`` (its own private Ray, whose SIGTERM handler it replaces) gets SIGTERM after its
first step, and SIGUSR1 once it has said so (a second signal, during its save): it saves the
step although ``trainer.save_freq=0`` never would, and exits 75 with one line naming the checkpoint
and the command to resume with (its own). The run's ``checkpoints/`` is a tmpfs (mounted by the test:
root needed) with room for three checkpoints, two of them taken by other data: the resumed run's next
save hits ENOSPC inside the actor's Megatron writer, and the run stops with one line naming the path,
a full disk (not the writer's internal text), the free space and what the save needs (the last
checkpoint's size) and that ``latest`` still
names the preemption's checkpoint, leaving no partial directory. Once the other data is gone, the run
resumes from there to the metrics of the uninterrupted run.

Under torchrun a signal to one rank stops every rank after the same step.
"""

import math
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest
from fault_runs import (
    RECIPE,
    STEPS,
    assert_same_metrics,
    fault_overrides,
    metrics_of,
    run_signalled,
    wait_for,
)

from rltrain.config import load_config
from rltrain.trainer.preemption import PREEMPTED_EXIT_CODE

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGE = 4096


def tmpfs_bytes(directory) -> int:
    """What ``directory``'s files take on a tmpfs (whole pages)."""
    return sum(math.ceil(p.stat().st_size / PAGE) * PAGE for p in directory.rglob("*") if p.is_file())


def test_sigterm_saves_and_exits_75_then_a_full_disk_stops_the_resumed_save_then_it_resumes(
    local_ray, fault_cache, reference, tmp_path, capsys
):
    from rltrain.orchestrator.entry import train
    from rltrain.train import run_and_report

    overrides = fault_overrides(tmp_path, fault_cache, "trainer.save_freq=0")
    run_dir = load_config(RECIPE, overrides).run_dir()
    ckpt = run_dir / "checkpoints"
    ckpt.mkdir(parents=True)
    one = tmpfs_bytes(reference.run_dir / "checkpoints" / "step_1")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={math.ceil(3.5 * one / 1024)}k", "tmpfs", str(ckpt)],
        capture_output=True,
        text=True,
    )
    assert mounted.returncode == 0, f"this test mounts a tmpfs (needs root): {mounted.stderr}"
    try:
        other_data = ckpt / "other-data.bin"
        other_data.write_bytes(b"\0" * (2 * one))

        def sigterm_then_sigusr1(driver: subprocess.Popen) -> None:
            # SIGUSR1 once the driver has taken SIGTERM (said at the step's end, before its save):
            # two signals pending together reach Python's handlers in signal-number order, SIGUSR1
            # (10) before SIGTERM (15), whatever order they were sent in (seen in CI with 0.3 s
            # between them while the driver's main thread waited in a call to Ray).
            driver.send_signal(signal.SIGTERM)
            taken = "SIGTERM received: saving a checkpoint"
            wait_for(
                lambda: (
                    taken in (run_dir / "rltrain.log").read_text(errors="replace")
                    or driver.poll() is not None
                ),
                timeout_s=300,
                what="the driver's line that it took SIGTERM",
            )
            driver.send_signal(signal.SIGUSR1)

        code, err = run_signalled(
            [sys.executable, "-m", "rltrain.cli", "train", str(RECIPE), *overrides],
            env={**os.environ, "RAY_ADDRESS": "local", "PYTHONUNBUFFERED": "1"},
            run_dir=run_dir,
            send=sigterm_then_sigusr1,
        )
        assert code == PREEMPTED_EXIT_CODE, err[-6000:]
        assert "Traceback" not in err
        found = re.fullmatch(
            r"rltrain train: stopped by SIGTERM after step (\d); its checkpoint is (\S+); resume with: (.+)",
            err.strip().splitlines()[-1],
        )
        assert found, err[-3000:]
        step, command = int(found[1]), shlex.split(found[3])
        assert 1 <= step < STEPS and found[2] == str(ckpt / f"step_{step}")
        assert (ckpt / "latest").read_text().strip() == f"step_{step}"
        assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "other-data.bin", f"step_{step}"]
        assert (
            "rltrain: WARNING: SIGTERM received: saving a checkpoint at this step's end, then stopping" in err
        )
        assert command == ["rltrain", "train", str(RECIPE), *overrides]

        # the resume, saving every step: its first save does not fit
        resumed = load_config(RECIPE, [*command[3:], "trainer.save_freq=1"])
        assert run_and_report("rltrain train", resumed, resume_command="unused") == 1
        line = capsys.readouterr().err.strip().splitlines()[-1]
        failed = f"step_{step + 1}"
        assert line.startswith(
            f"rltrain train: checkpoint {failed} could not be saved in {ckpt / ('.tmp-' + failed)}: "
        )
        # torch's writer reports the short write of a full disk as an "unexpected pos" in the file: the
        # line names the full disk instead, without the writers' internal text
        assert re.search(
            rf": no space left on the device \(\d+\.\d [KM]iB free there, about \d+\.\d MiB needed "
            rf"\(the size of step_{step}\)\); ",
            line,
        ), line
        assert "unexpected pos" not in line and "Exception" not in line, line
        assert line.endswith(f"; {ckpt / 'latest'} still names step_{step}"), line
        assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "other-data.bin", f"step_{step}"]
        print(f"the full disk's line: {line}")

        other_data.unlink()
        assert train(resumed) == STEPS
        assert (ckpt / "latest").read_text().strip() == f"step_{STEPS}"
        assert_same_metrics(metrics_of(run_dir), reference.metrics, range(1, STEPS + 1))
    finally:
        # lazily: a process of the run that still holds a file there (a Ray worker being reaped) made
        # a plain umount fail, leaving the mount behind in pytest's temp dir for good
        subprocess.run(["umount", "--lazy", str(ckpt)], check=False)


def test_under_torchrun_a_signal_to_one_rank_stops_every_rank_after_the_same_step(fault_cache, tmp_path):
    """SIGTERM to rank 1 alone: the ranks agree after the step, save it together (the role saves are
    collective) and stop; rank 0 prints the line and exits 75. torchrun itself reports that as a
    failure (its own exit code 1, naming exit code 75) and may stop the other rank, by then closing
    down after the save, with SIGTERM."""
    import psutil

    from rltrain.trainer.checkpoints import verify_path

    overrides = fault_overrides(
        tmp_path,
        fault_cache,
        "trainer.save_freq=0",
        "cluster.n_gpus_per_node=2",
        "actor.parallel.tensor_model_parallel_size=2",
        "critic.parallel.tensor_model_parallel_size=2",
    )
    run_dir = load_config(RECIPE, overrides).run_dir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1"]

    def sigterm_to_rank_1(launcher: subprocess.Popen) -> None:
        ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(launcher.pid).children()}
        ranks[1].send_signal(signal.SIGTERM)

    code, err = run_signalled(
        [*torchrun, "--nproc_per_node", "2", "-m", "rltrain.train", str(RECIPE), *overrides],
        env=env,
        run_dir=run_dir,
        send=sigterm_to_rank_1,
    )
    assert code == 1, err[-6000:]
    ours = [line for line in err.splitlines() if line.startswith("rltrain.train: ")]
    assert len(ours) == 1, err[-6000:]
    found = re.fullmatch(
        r"rltrain\.train: stopped by SIGTERM after step (\d); its checkpoint is (\S+); "
        r"resume with: the same torchrun command",
        ours[0],
    )
    assert found, ours
    step = int(found[1])
    assert 1 <= step < STEPS and found[2] == str(run_dir / "checkpoints" / f"step_{step}")
    assert "rltrain[rank 1]: WARNING: SIGTERM received" in err
    # the one traceback is torchrun's own report of ranks that exited non-zero
    assert err.count("Traceback") == 1 and "ChildFailedError" in err.split("Traceback")[1], err[-6000:]
    assert re.search(r"exitcode\s*: 75", err), err[-3000:]
    assert sorted(metrics_of(run_dir)) == list(range(step + 1))
    lines, all_well = verify_path(run_dir)
    assert all_well, lines
