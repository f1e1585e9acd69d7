"""``rltrain convert`` as a user runs it: a subprocess, its printed verification and its exit status."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rltrain.models.tiny import save_tiny_model

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[3]


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rltrain.cli", "convert", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_cli_converts_verifies_and_names_bad_input(tmp_path):
    src = save_tiny_model(tmp_path / "hf", "qwen2", seed=7)
    done = _convert("hf-to-mcore", str(src), str(tmp_path / "mcore"), "--tp", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hf-to-mcore at TP=2 PP=1 EP=1: 26 tensors" in done.stdout
    assert "round trip: 26 tensors bit-exact" in done.stdout
    logits = (
        r"logits vs transformers, both in float32 on 2×256 tokens: max abs diff (\S+) <= tolerance (\S+) "
    )
    found = re.search(
        logits + r"\(atol 0\.0001 \+ 3 × \S+, the most that running in float32 instead of float64",
        done.stdout,
    )
    diff, tolerance = float(found.group(1)), float(found.group(2))
    assert diff <= 1e-4 <= tolerance < 1.1e-4
    assert (tmp_path / "mcore" / "latest").read_text() == "step_0"

    (tmp_path / "empty").mkdir()
    failed = _convert("mcore-to-hf", str(tmp_path / "empty"), str(tmp_path / "out"), "--no-verify")
    assert failed.returncode == 1
    assert f"{tmp_path / 'empty'}: no Megatron checkpoint" in failed.stderr

    # A shard overwritten with zeros keeps its size: only a rank reading it finds out, and says so in
    # one line naming the file, without a traceback, leaving nothing at the destination.
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "mcore", damaged)
    shard = damaged / "step_0" / "__1_0.distcp"  # TP rank 1's half of every split tensor
    shard.write_bytes(bytes(shard.stat().st_size))
    failed = _convert("mcore-to-hf", str(damaged), str(tmp_path / "back"))
    assert failed.returncode == 1
    assert "Traceback" not in failed.stderr
    line = failed.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"convert mcore-to-hf failed: rank 0: {shard}: cannot read '[\w.]+': its stored bytes do not load "
        rf"\(UnpicklingError\); the file is damaged; nothing was written to {tmp_path / 'back'}",
        line,
    ), line
    assert not (tmp_path / "back").exists() and not (tmp_path / ".back.incomplete").exists()
