"""Jobs of tools/slurm/ray_cluster.sbatch on a local Slurm cluster (``start_local_slurm.sh``): one
node, or several nodes of a slurmd each on this machine (``SLURM_CONF`` names their configuration).

Every job is named ``rltrain-test``, has a time limit (Slurm ends a runaway job itself), is polled
with a bound and cancelled when its test ends. A job that fails, ends early or overruns fails its
test with what explains it: the job's state and reason, the queue, the nodes, the tails of job.out
and of the Slurm logs, and the job's processes.
"""

import os
import re
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
START_SLURM = Path(__file__).with_name("start_local_slurm.sh")
JOB_NAME = "rltrain-test"
TIME_LIMIT_MIN = 15  # Slurm's own bound on a job (the script asks for SIGUSR1 300 s before it)
JOB_TIMEOUT_S = 600  # a job takes 35-60 s on 2 idle cores, 140 s beside another run (requeue test: two runs)
ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
    "REQUEUE_HOLD",  # not ended, but it would wait for an operator
    "SPECIAL_EXIT",
    "GONE",  # purged from slurmctld's memory (MinJobAge after its end)
}
SLURM_LOGS = [Path("/var/log/slurm/slurmctld.log"), Path("/var/log/slurm/slurmd.log")]
"""The one-node cluster's logs; a cluster of several nodes keeps its own beside its ``SLURM_CONF``."""


def slurm_logs() -> list[Path]:
    conf = os.environ.get("SLURM_CONF")
    return sorted((Path(conf).parent / "log").glob("*.log")) if conf else SLURM_LOGS


def ray_tmp_of(gcs_port: int) -> str:
    """The Ray temp dir of the job whose head listens on ``gcs_port``; it names the job's Ray processes."""
    return f"/tmp/rs-{gcs_port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_text(*cmd: str, timeout_s: float = 10) -> str:
    """What ``cmd`` prints (stdout and stderr), for a report; never raises."""
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"({' '.join(cmd)}: no answer within {timeout_s:g} s)"
    except OSError as err:
        return f"({' '.join(cmd)}: {err})"
    return (done.stdout + done.stderr).rstrip()


def clip(text: str, *, num_lines: int, width: int = 240) -> str:
    """The first ``num_lines`` lines of ``text``, each cut at ``width`` (Ray's command lines are long)."""
    return "\n".join(line[:width] for line in text.splitlines()[:num_lines])


def tail(path: Path, num_lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError as err:
        return f"({path}: {err.strerror})"


def busiest_processes(num: int) -> str:
    """The ``num`` live processes with the highest %CPU (averaged over each one's life), zombies left out."""
    listed = command_text("ps", "-eo", "pid,ppid,stat,etime,time,pcpu,rss,args", "--sort=-pcpu").splitlines()
    live = [line for line in listed[1:] if not line.split()[2:3] or not line.split()[2].startswith("Z")]
    return clip("\n".join(listed[:1] + live), num_lines=num + 1)


def cluster_report() -> str:
    """The queue, the node, the load, the busiest processes and the tails of the Slurm daemons' logs."""
    sections = {
        "squeue": command_text("squeue", "-o", "%i %j %T %r %M %l %N"),
        "sinfo (node, state, reason)": command_text("sinfo", "-N", "-h", "-o", "%N %T %E"),
        "load": tail(Path("/proc/loadavg"), 1),
        "busiest processes": busiest_processes(15),
        **{f"{log} (last 30 lines)": tail(log, 30) for log in slurm_logs()},
    }
    return "\n".join(f"--- {title}\n{text}" for title, text in sections.items())


@dataclass(frozen=True)
class Job:
    """A submitted job of tools/slurm/ray_cluster.sbatch."""

    job_id: str
    out: Path  # its output file (job.out)
    gcs_port: int  # its Ray head's port

    @property
    def ray_tmp(self) -> str:
        return ray_tmp_of(self.gcs_port)

    def state(self) -> str:
        """JobState; GONE once slurmctld forgot the job, NO_ANSWER when it does not answer."""
        try:
            shown = subprocess.run(
                ["scontrol", "show", "job", self.job_id], capture_output=True, text=True, timeout=10
            )
        except subprocess.TimeoutExpired:
            return "NO_ANSWER"
        found = re.search(r"JobState=(\w+)", shown.stdout)
        if found:
            return found[1]
        return "GONE" if "Invalid job id" in shown.stderr else "NO_ANSWER"

    def log(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def report(self) -> str:
        """Everything a failed or overrun job can be diagnosed from, as text."""
        listed = command_text("scontrol", "listpids", self.job_id)
        pids = [line.split()[0] for line in listed.splitlines() if line[:1].isdigit()]
        processes = (
            clip(
                command_text("ps", "-o", "pid,ppid,stat,etime,time,pcpu,args", "-p", ",".join(pids)),
                num_lines=40,
            )
            if pids
            else listed
        )
        sections = {
            f"scontrol show job {self.job_id}": command_text("scontrol", "show", "job", self.job_id),
            f"{self.out} (last 80 lines)": tail(self.out, 80),
            f"processes of job {self.job_id} (scontrol listpids)": processes,
            f"processes of its Ray ({self.ray_tmp})": clip(
                command_text("pgrep", "-af", self.ray_tmp), num_lines=20
            )
            or "(none)",
        }
        job_part = "\n".join(f"--- {title}\n{text}" for title, text in sections.items())
        return f"{job_part}\n{cluster_report()}"

    def wait(self, what: str, condition: Callable[[], bool], *, timeout_s: float) -> None:
        """Poll ``condition`` each second until it holds; fail with the report when ``timeout_s``
        passes or the job ends first."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            state = self.state()
            if state in ENDED and not condition():
                pytest.fail(
                    f"job {self.job_id} ended ({state}) before {what}\n{self.report()}", pytrace=False
                )
            if time.monotonic() > deadline:
                pytest.fail(
                    f"no {what} within {timeout_s:g} s (job {self.job_id} is {state})\n{self.report()}",
                    pytrace=False,
                )
            time.sleep(1)

    def wait_until_ended(self, *, timeout_s: float) -> str:
        """The job's final state, polled each second; fails with the report after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (state := self.state()) not in ENDED:
            if time.monotonic() > deadline:
                pytest.fail(
                    f"job {self.job_id} did not end within {timeout_s:g} s (it is {state})\n{self.report()}",
                    pytrace=False,
                )
            time.sleep(1)
        return state

    def cancel(self) -> None:
        subprocess.run(["scancel", self.job_id], capture_output=True, timeout=30, check=False)


def cancel_leftover_jobs(*, timeout_s: float = 120) -> None:
    """Cancel the queued jobs of the tests' name (an earlier run's: pending, requeued, or running
    without processes after a restart of the daemons) and wait until the queue has none of them."""

    def leftovers() -> str:
        listed = subprocess.run(
            ["squeue", "-h", f"--name={JOB_NAME}", "-o", "%i %T %r %M"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return listed.stdout.strip()

    found = leftovers()
    if not found:
        return
    print(f"cancelling jobs named {JOB_NAME} that an earlier run left:\n{found}")
    subprocess.run(["scancel", f"--name={JOB_NAME}"], check=True, timeout=30)
    deadline = time.monotonic() + timeout_s
    while left := leftovers():
        if time.monotonic() > deadline:
            pytest.fail(
                f"jobs named {JOB_NAME} that an earlier run left are still queued {timeout_s:g} s after "
                f"scancel:\n{left}\n{cluster_report()}",
                pytrace=False,
            )
        time.sleep(1)


def start_local_slurm(nodes: int = 1) -> list[tuple[str, int]]:
    """Each node's name and CPU count of the local cluster of ``nodes`` (started if it is not up),
    once no earlier test job is left in its queue."""
    subprocess.run(["bash", str(START_SLURM), str(nodes)], check=True, timeout=900)
    cancel_leftover_jobs()
    listed = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %c"], capture_output=True, text=True, check=True, timeout=30
    ).stdout.split()
    return [(name, int(cpus)) for name, cpus in zip(listed[::2], listed[1::2], strict=True)]


def submit(
    tmp_path: Path, overrides: list[str], *, cpus: int, nodes: int = 1, env: tuple[str, ...] = ()
) -> Job:
    """``sbatch`` of tools/slurm/ray_cluster.sbatch running the quickstart on ``nodes`` nodes of
    ``cpus`` CPUs each, Ray on free ports; ``env``: more of the script's variables (``NAME=value``)."""
    gcs = free_port()

    def agent_ports() -> str:  # Ray's defaults are fixed ports: two nodes on one machine need their own
        return f"--dashboard-agent-listen-port={free_port()} --dashboard-agent-grpc-port={free_port()}"

    env_vars = ",".join(
        [
            "ALL",
            f"RAY_PORT={gcs}",
            f"RAY_DASHBOARD_PORT={free_port()}",
            f"RLTRAIN_PYTHON={ROOT / '.venv' / 'bin' / 'python'}",
            f"RAY_TMP={ray_tmp_of(gcs)}",
            f"RAY_HEAD_START_ARGS={agent_ports()}",
            f"RAY_WORKER_START_ARGS={agent_ports()}",
            *env,
        ]
    )
    cmd = [
        "sbatch",
        "--parsable",
        f"--job-name={JOB_NAME}",
        f"--time={TIME_LIMIT_MIN}",
        f"--export={env_vars}",
        f"--nodes={nodes}",
        f"--cpus-per-task={cpus}",
        f"--output={tmp_path / 'job.out'}",
        f"--chdir={ROOT}",
        str(ROOT / "tools" / "slurm" / "ray_cluster.sbatch"),
        "recipes/quickstart_cpu.yaml",
        f"trainer.default_local_dir={tmp_path / 'runs'}",
        f"model.cache_dir={tmp_path / 'cache'}",
        "trainer.test_freq=0",
        *overrides,
    ]
    submitted = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, f"sbatch failed: {submitted.stderr}\n{cluster_report()}"
    return Job(submitted.stdout.strip().split(";")[0], tmp_path / "job.out", gcs)
