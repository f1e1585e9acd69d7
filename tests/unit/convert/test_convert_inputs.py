"""``rltrain convert`` refuses bad input before any rank starts, in one line naming the culprit.

Each case runs the CLI's ``main`` in this process with the rank launcher replaced by one that fails
the test: a refusal must come from the checks, not from a rank. The Megatron sources are torch DCP
checkpoints laid out as a conversion writes them (``latest``, ``step_0/`` with its metadata).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from rltrain.convert import cli, launch
from rltrain.models.tiny import save_tiny_model


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("hf") / "qwen2", "qwen2", seed=0)


@pytest.fixture
def hf(tiny_hf, tmp_path) -> Path:
    """A fresh copy of the tiny qwen2 checkpoint (4 heads, 2 KV heads, 2 layers) to damage."""
    return Path(shutil.copytree(tiny_hf, tmp_path / "hf"))


@pytest.fixture
def mcore(tiny_hf, tmp_path) -> Path:
    root = tmp_path / "mcore"
    dcp.save({"w": torch.randn(64, 16)}, checkpoint_id=str(root / "step_0"), no_dist=True)
    (root / "step_0" / "metadata.json").write_text("{}")
    (root / "latest").write_text("step_0")
    shutil.copytree(tiny_hf, root / "hf", ignore=shutil.ignore_patterns("*.safetensors"))
    return root


@pytest.fixture(autouse=True)
def no_ranks(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a conversion rank was started for an input the checks should refuse")

    monkeypatch.setattr(launch, "_run_ranks", refuse)


def _refusal(capsys, *argv: str) -> str:
    """The single line ``rltrain convert`` prints on stderr when it refuses ``argv`` (exit status 1)."""
    assert cli.main(list(argv)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.strip()


def test_an_unsupported_family_lists_the_supported_ones(capsys, hf, tmp_path):
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    assert _refusal(capsys, "hf-to-mcore", str(hf), str(tmp_path / "out")) == (
        f"convert hf-to-mcore failed: {hf / 'config.json'}: no weight bridge for HF model_type='gpt2'; "
        "supported model types: deepseek_v2, deepseek_v3, glm4_moe, gpt_oss, kimi_k2, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe"
    )


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda raw: raw[:8] + b"\xff" * 32 + raw[40:], "not a safetensors file (its "),
        (lambda raw: raw[:-1000], "truncated: "),
    ],
    ids=["garbage-header", "truncated"],
)
def test_an_unreadable_safetensors_file_is_named(capsys, hf, tmp_path, damage, reason):
    shard = hf / "model.safetensors"
    shard.write_bytes(damage(shard.read_bytes()))
    line = _refusal(capsys, "hf-to-mcore", str(hf), str(tmp_path / "out"))
    assert line.startswith(f"convert hf-to-mcore failed: {shard}: {reason}"), line


def test_a_missing_tensor_is_named(capsys, hf, tmp_path):
    from safetensors.torch import load_file, save_file

    state = load_file(hf / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, hf / "model.safetensors", metadata={"format": "pt"})
    assert _refusal(capsys, "hf-to-mcore", str(hf), str(tmp_path / "out")) == (
        f"convert hf-to-mcore failed: HF checkpoint {hf}: missing tensors "
        "['model.layers.1.mlp.up_proj.weight']; unexpected tensors []"
    )


@pytest.mark.parametrize(
    ("tp", "pp", "ep", "problem"),
    [
        (4, 1, 1, "tensor_model_parallel_size=4 does not divide num_key_value_heads=2"),
        (
            1,
            3,
            1,
            "pipeline_model_parallel_size × virtual=3 does not divide num_hidden_layers=2 (set "
            "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage for uneven stages)",
        ),
        (1, 1, 2, "expert_model_parallel_size=2 does not divide num_experts=0"),
    ],
    ids=["tp-over-kv-heads", "pp-over-layers", "ep-without-experts"],
)
def test_a_layout_the_model_cannot_take_names_both_numbers(capsys, hf, tmp_path, tp, pp, ep, problem):
    flags = ["--tp", str(tp), "--pp", str(pp), "--ep", str(ep)]
    assert _refusal(capsys, "hf-to-mcore", str(hf), str(tmp_path / "out"), *flags) == (
        f"convert hf-to-mcore failed: {hf / 'config.json'}: the qwen2 model cannot take "
        f"--tp {tp} --pp {pp} --ep {ep}: {problem}"
    )


def test_uneven_stages_that_do_not_add_up_are_refused(capsys, hf, tmp_path):
    flags = ["--pp", "2", "--decoder-first-pipeline-num-layers", "3"]
    assert _refusal(capsys, "hf-to-mcore", str(hf), str(tmp_path / "out"), *flags) == (
        f"convert hf-to-mcore failed: {hf / 'config.json'}: the qwen2 model cannot take "
        "--tp 1 --pp 2 --ep 1 --decoder-first-pipeline-num-layers 3: num_layers_in_first_pipeline_stage=3 "
        "leaves -1 of num_hidden_layers=2 for the 1 middle stage(s) of pipeline_model_parallel_size=2"
    )


def test_a_layout_is_checked_for_megatron_sources_too(capsys, mcore, tmp_path):
    line = _refusal(capsys, "mcore-to-mcore", str(mcore), str(tmp_path / "out"), "--tp", "4")
    assert line.endswith("tensor_model_parallel_size=4 does not divide num_key_value_heads=2"), line


def test_a_non_empty_destination_is_refused_and_left_alone(capsys, hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_text("stale")
    assert _refusal(capsys, "hf-to-mcore", str(hf), str(out)) == (
        f"convert hf-to-mcore failed: {out} is not empty (1 entries, e.g. model-00001-of-00002.safetensors): "
        "convert into a new directory, or pass --overwrite to clear it first"
    )
    assert (out / "model-00001-of-00002.safetensors").read_text() == "stale"


def test_overwrite_never_clears_the_source(capsys, mcore):
    line = _refusal(capsys, "mcore-to-hf", str(mcore), str(mcore), "--overwrite")
    assert line == (
        f"convert mcore-to-hf failed: --overwrite would delete {mcore}, which {mcore} holds; "
        "choose another directory"
    )
    assert (mcore / "latest").is_file()


@pytest.mark.parametrize("flag", ["--tp", "--pp", "--ep"])
def test_a_parallel_size_below_one_is_refused_by_the_parser(capsys, hf, tmp_path, flag):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["hf-to-mcore", str(hf), str(tmp_path / "out"), flag, "0"])
    assert exit_.value.code == 2
    assert f"argument {flag}: must be a whole number of 1 or more, got '0'" in capsys.readouterr().err


def test_a_truncated_megatron_shard_is_named(capsys, mcore, tmp_path):
    (shard,) = (mcore / "step_0").glob("*.distcp")
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-100])
    assert _refusal(capsys, "mcore-to-hf", str(mcore), str(tmp_path / "out")) == (
        f"convert mcore-to-hf failed: {shard}: truncated: {size - 100} bytes, the checkpoint's .metadata "
        f"places tensor data up to byte {size}"
    )


def test_garbled_megatron_metadata_is_named(capsys, mcore, tmp_path):
    (mcore / "step_0" / ".metadata").write_bytes(b"\x00" * 64)
    line = _refusal(capsys, "mcore-to-hf", str(mcore), str(tmp_path / "out"))
    assert line.startswith(f"convert mcore-to-hf failed: {mcore / 'step_0' / '.metadata'}: unreadable ("), (
        line
    )


def test_latest_naming_an_incomplete_step_is_named(capsys, mcore, tmp_path):
    (mcore / "latest").write_text("step_7")
    assert _refusal(capsys, "mcore-to-hf", str(mcore), str(tmp_path / "out")) == (
        f"convert mcore-to-hf failed: {mcore / 'latest'} names {mcore / 'step_7'}, which is not a complete "
        "checkpoint (no metadata.json)"
    )


def test_a_missing_hf_config_names_the_flag_to_pass(capsys, mcore, tmp_path):
    shutil.rmtree(mcore / "hf")
    assert _refusal(capsys, "mcore-to-hf", str(mcore), str(tmp_path / "out")) == (
        f"convert mcore-to-hf failed: {mcore / 'hf' / 'config.json'} is missing: the HF config (and "
        "tokenizer) of the model; pass --hf-config DIR (the model it was trained from)"
    )


# What Megatron's dist_checkpointing writes beside a torch_dist checkpoint (its common state in common.pt).
MEGATRON_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


def _moe_source(tmp_path: Path, model_type: str, *, bias: bool, routing: dict | None) -> Path:
    """A Megatron source of a tiny ``model_type`` MoE: ``bias`` adds a router expert-bias tensor
    (under the key Megatron stores it), ``routing`` the record ``save_checkpoint`` keeps in the
    common state (None: a checkpoint written before that record)."""
    from rltrain.models.tiny import tiny_hf_config

    root = tmp_path / "mcore"
    tensors = {"decoder.layers.mlp.router.weight": torch.randn(2, 4, 16)}
    if bias:
        tensors["decoder.layers.mlp.router.expert_bias"] = torch.zeros(2, 4)
    dcp.save(tensors, checkpoint_id=str(root / "step_3"), no_dist=True)
    (root / "step_3" / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))
    if routing is not None:
        torch.save({"meta": {"step": 3, "routing": routing}}, root / "step_3" / "common.pt")
    (root / "latest").write_text("step_3")
    tiny_hf_config(model_type, vocab_size=512).save_pretrained(root / "hf")
    return root


def test_an_expert_bias_the_family_cannot_hold_is_refused_before_the_record_existed(capsys, tmp_path):
    """A Mixtral actor trained with aux-loss-free routing, saved before checkpoints recorded the
    routing: its expert-bias tensors give it away; an export would drop them and route by softmax."""
    src = _moe_source(tmp_path, "mixtral", bias=True, routing=None)
    assert _refusal(capsys, "mcore-to-hf", str(src), str(tmp_path / "out")) == (
        f"convert mcore-to-hf failed: {src / 'step_3'}: its routers were trained with "
        "model.moe.moe_router_enable_expert_bias: true (it holds decoder.layers.mlp.router.expert_bias), "
        f"but the mixtral model of {src / 'hf' / 'config.json'} routes by a softmax score and no expert "
        "bias: converting it would change which experts every token is sent to; keep this run's "
        "checkpoints in Megatron form (resume and evaluate with the same model.moe options)"
    )


def test_a_sigmoid_score_on_a_softmax_family_is_refused_from_the_record(capsys, tmp_path):
    """A reshard builds the family's model too, so it would lose the trained routing the same way."""
    src = _moe_source(
        tmp_path, "qwen3_moe", bias=False, routing={"score_function": "sigmoid", "expert_bias": False}
    )
    line = _refusal(capsys, "mcore-to-mcore", str(src), str(tmp_path / "out"))
    assert line.startswith(
        f"convert mcore-to-mcore failed: {src / 'step_3'}: its routers were trained with "
        "model.moe.moe_router_score_function: sigmoid, but the qwen3_moe model of "
    ), line


def test_routing_the_family_computes_passes(tmp_path):
    """DeepSeek-V3's own routing (sigmoid scores with an expert bias), and Mixtral's (softmax) as a
    conversion records it: the checks return the HF directory."""
    from rltrain.convert.inputs import check_inputs

    for model_type, bias, routing in (
        ("deepseek_v3", True, {"score_function": "sigmoid", "expert_bias": True}),
        ("mixtral", False, {"score_function": "softmax", "expert_bias": False}),
    ):
        src = _moe_source(tmp_path / model_type, model_type, bias=bias, routing=routing)
        hf_dir = check_inputs(
            "mcore-to-hf",
            src,
            tmp_path / model_type / "out",
            hf_config_dir=None,
            tp=1,
            pp=1,
            ep=1,
            overwrite=False,
        )
        assert hf_dir == src / "hf"
