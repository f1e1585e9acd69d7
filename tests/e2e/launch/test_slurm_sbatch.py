"""tools/slurm/ray_cluster.sbatch on a real one-node Slurm (Debian's slurm-wlm on localhost).

The fixture installs and starts munged, slurmctld and slurmd (tests/e2e/slurm/start_local_slurm.sh,
root needed) and cancels the jobs of the tests' name that an earlier run left in the queue: Slurm's
state outlives its daemons, and a job whose processes died with them comes back as running when the
daemons restart, holding the (exclusive) node until slurmctld gives up on it half an hour later.
The first job starts a Ray head through srun, waits for the node, runs the quickstart for two steps
and stops Ray again. A second job gets SIGUSR1 (what the script asks Slurm to send ahead of its time
limit), saves, requeues itself and resumes.

Every job is named ``rltrain-test``, has a time limit (Slurm ends a runaway job itself), is polled
with a bound and cancelled when its test ends. A job that fails, ends early or overruns fails its
test with what explains it: the job's state and reason, the queue, the node, the tails of job.out
and of the Slurm logs, and the job's processes.
"""

import json
import re
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
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
        **{f"{log} (last 30 lines)": tail(log, 30) for log in SLURM_LOGS},
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


@pytest.fixture(scope="module")
def slurm() -> tuple[str, int]:
    """The local node's name and CPU count, once no earlier test job is left in the queue."""
    subprocess.run(
        ["bash", str(ROOT / "tests" / "e2e" / "slurm" / "start_local_slurm.sh")], check=True, timeout=900
    )
    cancel_leftover_jobs()
    node, cpus = subprocess.run(
        ["sinfo", "-h", "-o", "%n %c"], capture_output=True, text=True, check=True, timeout=30
    ).stdout.split()
    return node, int(cpus)


def submit(cpus: int, tmp_path: Path, overrides: list[str]) -> Job:
    """``sbatch`` of tools/slurm/ray_cluster.sbatch on the local node, Ray on free ports."""
    gcs = free_port()
    agent_ports = f"--dashboard-agent-listen-port={free_port()} --dashboard-agent-grpc-port={free_port()}"
    env_vars = (
        f"ALL,RAY_PORT={gcs},RAY_DASHBOARD_PORT={free_port()},RLTRAIN_PYTHON={ROOT / '.venv' / 'bin' / 'python'},"
        f"RAY_TMP={ray_tmp_of(gcs)},RAY_START_ARGS={agent_ports},"
        # one local node: its host name need not resolve (on this machine `x` resolves nowhere)
        "RAY_HEAD_IP=127.0.0.1"
    )
    cmd = [
        "sbatch",
        "--parsable",
        f"--job-name={JOB_NAME}",
        f"--time={TIME_LIMIT_MIN}",
        f"--export={env_vars}",
        "--nodes=1",
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


def test_sbatch_runs_recipe_on_ray_cluster_and_tears_down(slurm, tmp_path):
    node, cpus = slurm
    run_dir = tmp_path / "runs" / "quickstart" / "tiny_llama_arith"
    pipeline = [
        "trainer.pipeline=fully_async",
        "trainer.max_staleness=1",
        "rollout.mode=separate",
        "rollout.num_devices=1",
    ]
    job = submit(
        cpus,
        tmp_path,
        ["trainer.total_training_steps=2", "critic.warmup_steps=0", "trainer.save_freq=2", *pipeline],
    )
    try:
        state = job.wait_until_ended(timeout_s=JOB_TIMEOUT_S)
    finally:
        job.cancel()
    log = job.log()
    assert state == "COMPLETED", f"job {job.job_id} ended {state}\n{job.report()}"
    assert f"rltrain: 1 node(s) {node}" in log and "rltrain: all 1 node(s) joined" in log
    assert "joined the running Ray cluster" in log
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    # fully asynchronous generation under the bound: batch 1 from the initial weights, batch 2 at
    # most one version old
    assert records[1]["async/staleness_max"] == 0.0 and records[2]["async/staleness_max"] <= 1.0
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_2"
    # torn down: nothing listens on the head's GCS port any more
    time.sleep(2)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", job.gcs_port)) != 0, "the Ray head is still running after the job"
    leftovers = subprocess.run(["pgrep", "-f", f"{job.ray_tmp}/"], capture_output=True, text=True).stdout
    assert leftovers == "", f"Ray processes of the job survived it: {leftovers}"


def test_sigusr1_saves_and_the_job_requeues_itself_and_resumes(slurm, tmp_path):
    """What Slurm does ahead of a time limit with the script's ``--signal=B:USR1@300``, sent at once:
    the batch shell passes SIGUSR1 to the driver, which saves its step (``save_freq=0`` would not) and
    exits 75; the script requeues the job, whose next run resumes from that checkpoint and finishes."""
    _, cpus = slurm
    run_dir = tmp_path / "runs" / "quickstart" / "tiny_llama_arith"
    metrics = run_dir / "metrics.jsonl"
    # Steps to spare after step 1: the signal goes out once step 1 is logged and reaches the driver
    # through scancel and the batch shell; at 0.65 s a step (an idle machine) it once arrived during
    # step 3 of 3, and a run that finishes has nothing to requeue.
    steps = 8
    job = submit(
        cpus,
        tmp_path,
        [
            "model.tiny.sft_warmup_steps=20",
            f"trainer.total_training_steps={steps}",
            "critic.warmup_steps=0",
            "trainer.save_freq=0",
        ],
    )
    try:
        job.wait(
            "step 1 in metrics.jsonl",
            lambda: metrics.exists() and '"step": 1' in metrics.read_text(),
            timeout_s=JOB_TIMEOUT_S,
        )
        subprocess.run(["scancel", "--batch", "--signal=USR1", job.job_id], check=True, timeout=30)
        job.wait("requeue", lambda: "rltrain: requeueing job" in job.log(), timeout_s=300)
        # a requeued job waits two minutes before it may start again; the test waits 5 s: a start in
        # the second of the requeue is refused ("Killing non-startable batch JobId=N: Job credential
        # revoked": slurmd compares the new credential's time with the revocation's, in seconds)
        job.wait("pending requeued job", lambda: job.state() == "PENDING", timeout_s=60)
        subprocess.run(
            ["scontrol", "update", f"JobId={job.job_id}", "StartTime=now+5"], check=True, timeout=30
        )
        state = job.wait_until_ended(timeout_s=JOB_TIMEOUT_S)
    finally:
        job.cancel()
    log = job.log()
    assert state == "COMPLETED", f"job {job.job_id} ended {state}\n{job.report()}"
    assert "rltrain: SIGUSR1 received: the run saves a checkpoint after its current step and stops" in log
    stopped = re.search(
        r"^rltrain\.train: stopped by SIGUSR1 after step (\d); its checkpoint is (\S+); ", log, re.M
    )
    assert stopped, log[-6000:]
    step = int(stopped[1])
    assert 1 <= step < steps and stopped[2] == str(run_dir / "checkpoints" / f"step_{step}")
    assert "rltrain: run 1 after a requeue: resuming from the last checkpoint" in log
    logged = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert logged == [0, *range(1, step + 1), 0, *range(step + 1, steps + 1)], logged
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{step}'} (step {step})" in log
