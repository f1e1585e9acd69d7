"""The ``wandb`` metrics backend in offline mode (no network): its run sits under the run directory and
its history, read back from the ``.wandb`` file, holds what was logged; the mode's rules; the
optional package refused in one line naming ``trainer.logger``. The run log: per-sample TRACE lines
and W&B's messages land in the log file, never on the terminal (a subprocess: the set-up rewires
file descriptors 1 and 2)."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest

from rltrain.config import ConfigError, load_config
from rltrain.errors import RunStopped
from rltrain.logging.console import is_own_worker_line
from rltrain.logging.tracker import MetricsLogger
from rltrain.logging.wandb_run import WandbBackend, WandbOptions, resolve_mode

BLOCK = 32768
"""The ``.wandb`` file is a LevelDB-style log: a 7-byte header, then records in 32 KiB blocks."""


def wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file, each record's CRC checked."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if left < 7 or (length, kind) == (0, 0):  # the rest of the block is padding
            pos += left
            continue
        body = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == crc, f"bad record at byte {pos}"
        pos += 7 + length
        pending += body
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def history(path: Path) -> list[dict]:
    rows = []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            rows.append({k: v for k, v in items.items() if not k.startswith("_")})
    return rows


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """No API key, no mode from outside; W&B's own folders in ``tmp_path`` (not the home directory)."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name, sub in (
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_DATA_DIR", "data"),
    ):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home" / sub))
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "true")  # offline turns it off (and the fixture restores it)
    return tmp_path


def test_offline_run_under_the_run_dir_holds_what_was_logged(wandb_env):
    run_dir = wandb_env / "quickstart" / "tiny_llama_arith"
    options = WandbOptions(project="quickstart", name="tiny_llama_arith", config={"actor": {"lr": 3.0e-4}})
    with MetricsLogger(run_dir, backends=("jsonl", "wandb"), wandb=options) as logger:
        assert logger.wandb.mode == "offline"
        assert os.environ["WANDB_ERROR_REPORTING"] == "false"
        logger.log({"reward/mean": 0.25, "actor/kl": 1.5e-3}, step=1)
        logger.log({"reward/mean": 0.5, "actor/kl": float("nan")}, step=2)
        logger.log({"reward/mean": 0.75}, step=2)  # a step logged again (a restart) is a row of its own
    (run,) = (run_dir / "wandb").glob("offline-run-*")
    (log_file,) = run.glob("run-*.wandb")
    rows = history(log_file)
    assert len(rows) == 3
    assert rows[0] == {"step": 1, "reward/mean": 0.25, "actor/kl": 1.5e-3}
    assert math.isnan(rows[1].pop("actor/kl")) and rows[1] == {"step": 2, "reward/mean": 0.5}
    assert rows[2] == {"step": 2, "reward/mean": 0.75}
    (meta,) = [r.run for r in wandb_records(log_file) if r.WhichOneof("record_type") == "run"]
    assert (meta.project, meta.display_name) == ("quickstart", "tiny_llama_arith")
    config = {item.key: json.loads(item.value_json) for item in meta.config.update}
    assert config["actor"] == {"lr": 3.0e-4}
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/mean"] for r in jsonl] == [0.25, 0.5, 0.75]


def test_auto_mode_goes_online_only_with_a_key_or_an_explicit_wandb_mode():
    assert resolve_mode("auto", {}) == "offline"
    assert resolve_mode("auto", {"WANDB_API_KEY": "k"}) == "online"
    assert resolve_mode("auto", {"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}) == "offline"
    assert resolve_mode("auto", {"WANDB_MODE": "online"}) == "online"
    assert resolve_mode("offline", {"WANDB_API_KEY": "k"}) == "offline"
    assert resolve_mode("online", {}) == "online"


def test_wandb_logger_without_the_package_is_refused_in_one_line(tmp_path, monkeypatch):
    overrides = [f"trainer.default_local_dir={tmp_path}", "trainer.logger=[console,wandb]"]
    config = load_config("recipes/quickstart_cpu.yaml", overrides)
    assert config.trainer.logger == ["console", "wandb"]
    options = WandbOptions.of(config)
    assert (options.project, options.name, options.mode) == ("quickstart", "tiny_llama_arith", "auto")
    assert options.config["actor"]["optim"]["lr"] == 2.0e-4  # the resolved config, as plain data
    real = importlib.metadata.version

    def without_wandb(name: str) -> str:
        if name == "wandb":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", without_wandb)
    with pytest.raises(ConfigError) as err:
        load_config("recipes/quickstart_cpu.yaml", overrides)
    assert (
        "trainer.logger includes wandb, but the wandb package is not installed: pip install 'wandb==0.31.0'"
        in str(err.value)
    )
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "0.19.0" if name == "wandb" else real(name)
    )
    with pytest.raises(ConfigError, match=r"wandb 0\.19\.0 is installed, this release needs wandb==0\.31\.0"):
        load_config("recipes/quickstart_cpu.yaml", overrides)
    monkeypatch.setitem(sys.modules, "wandb", None)  # the import itself fails (a library caller)
    with pytest.raises(
        RunStopped, match=r"^trainer\.logger includes wandb, but the wandb package is not installed"
    ):
        WandbBackend(tmp_path, WandbOptions(project="p", name="e"))


RUN_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    from rltrain.logging.console import TRACE, capture_run_output, log_path, start_console
    from rltrain.logging.tracker import MetricsLogger
    from rltrain.logging.wandb_run import WandbOptions

    start_console()
    capture_run_output(log_path(sys.argv[1]))
    logging.getLogger("rltrain.samples").log(TRACE, "rollout step1-p0-s0: finish=stop length=2")
    options = WandbOptions(project="p", name="e", mode="offline")
    with MetricsLogger(sys.argv[1], backends=("wandb",), wandb=options) as logger:
        logger.log({"reward/mean": 0.5}, step=1)
    """
)

WORKER_SCRIPT = textwrap.dedent(
    """
    import logging
    from rltrain.logging.console import TRACE, configure_worker_logging

    configure_worker_logging()
    logging.getLogger("rltrain.samples").log(TRACE, "train actor rank 0 (dp 0/1) mini-batch 1/1: step1-p0-s0")
    logging.getLogger("vllm").log(TRACE, "third-party records below INFO stay out")
    """
)


def test_sample_lines_and_wandb_messages_reach_the_run_log_not_the_terminal(wandb_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_API")}
    done = subprocess.run(
        [sys.executable, "-c", RUN_SCRIPT, str(wandb_env / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    log_text = (wandb_env / "run" / "rltrain.log").read_text()
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"rltrain: logs of Ray, vLLM, Megatron and other libraries: {wandb_env / 'run' / 'rltrain.log'} "
        "(--verbose shows them here)"
    ]
    assert " TRACE rltrain.samples: rollout step1-p0-s0: finish=stop length=2\n" in log_text
    assert f"wandb: Run data is saved locally in {wandb_env / 'run' / 'wandb'}" in log_text

    worker = subprocess.run(
        [sys.executable, "-c", WORKER_SCRIPT], capture_output=True, text=True, timeout=60, env=env
    )
    line = "TRACE rltrain.samples: train actor rank 0 (dp 0/1) mini-batch 1/1: step1-p0-s0"
    assert worker.stderr.splitlines() == [line]
    assert not is_own_worker_line(
        f"(actor_rollout_ref rank 0 pid=7) {line}"
    )  # Ray forwards it: log file only
