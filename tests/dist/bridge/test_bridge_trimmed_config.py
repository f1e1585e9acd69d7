"""A checkpoint whose ``config.json`` leaves out the keys transformers fills in by itself (its
``model_type``'s defaults) converts exactly like the same checkpoint with the full config (issue 42).

Every registered family's tiny model (DeepSeek-V3 in the configuration of the report), one rank
each; the facts, shapes and mapping tables of trimmed configs are compared beyond the tiny presets
in ``tests/unit/bridge/test_trimmed_hf_configs.py``.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from megatron_bridge.dcp_io import DistCheckpointReader
from megatron_bridge.hf_io import HFCheckpointReader
from rltrain.convert.launch import run_conversion
from rltrain.models.tiny import save_tiny_model
from tests.unit.bridge.trimmed_configs import trimmed

pytestmark = pytest.mark.dist

# DeepSeek-V3 routing to 8 experts in 4 of 8 groups with eps 1e-6, as the released model does: the
# report's config.json left num_experts_per_tok, n_group, topk_group and rms_norm_eps out.
REPORTED_V3 = {"n_routed_experts": 16, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4}


@pytest.mark.parametrize(
    ("model_type", "overrides", "left_out"),
    [
        pytest.param(
            "llama",
            {},
            {"rms_norm_eps", "head_dim", "tie_word_embeddings"},
            marks=pytest.mark.supports("llama", "conversion", "hf_parity"),
        ),
        pytest.param("qwen2", {}, set(), marks=pytest.mark.supports("qwen2", "conversion", "hf_parity")),
        pytest.param("qwen3", {}, set(), marks=pytest.mark.supports("qwen3", "conversion", "hf_parity")),
        pytest.param("mixtral", {}, set(), marks=pytest.mark.supports("mixtral", "conversion", "hf_parity")),
        pytest.param(
            "qwen2_moe", {}, set(), marks=pytest.mark.supports("qwen2_moe", "conversion", "hf_parity")
        ),
        pytest.param(
            "qwen3_moe", {}, set(), marks=pytest.mark.supports("qwen3_moe", "conversion", "hf_parity")
        ),
        pytest.param(
            "deepseek_v2", {}, set(), marks=pytest.mark.supports("deepseek_v2", "conversion", "hf_parity")
        ),
        pytest.param(
            "deepseek_v3",
            REPORTED_V3,
            {"num_experts_per_tok", "n_group", "topk_group", "rms_norm_eps"},
            marks=pytest.mark.supports("deepseek_v3", "conversion", "hf_parity"),
        ),
    ],
)
def test_trimmed_config_converts_exactly_like_the_full_one(tmp_path, model_type, overrides, left_out):
    full = save_tiny_model(tmp_path / "full", model_type, seed=1, **overrides)
    short = tmp_path / "trimmed"
    shutil.copytree(full, short)
    config = trimmed(json.loads((full / "config.json").read_text()))
    dropped = set(json.loads((full / "config.json").read_text())) - set(config)
    assert dropped and left_out <= dropped, dropped
    (short / "config.json").write_text(json.dumps(config, indent=2))

    run_conversion("hf-to-mcore", full, tmp_path / "mcore_full", verify=False)
    # verified: every tensor back bit for bit, the logits against transformers loading the trimmed config
    report = run_conversion("hf-to-mcore", short, tmp_path / "mcore_trimmed", atol=1e-4)
    assert report.bit_exact_tensors == len(HFCheckpointReader(full).names())
    assert report.max_abs_logit_diff <= 1e-5

    a = DistCheckpointReader(tmp_path / "mcore_full" / "step_0")
    b = DistCheckpointReader(tmp_path / "mcore_trimmed" / "step_0")
    keys = sorted(a.keys())
    assert keys == sorted(b.keys())
    for key in keys:
        shape = a.shape(key)
        assert b.shape(key) == shape and b.dtype(key) == a.dtype(key), key
        origin = (0,) * len(shape)
        assert torch.equal(a.read(key, origin, shape), b.read(key, origin, shape)), key

    # back to HF from the checkpoint that carries the trimmed config (its routing check reads it)
    run_conversion("mcore-to-hf", tmp_path / "mcore_trimmed", tmp_path / "back", verify=False)
    source, back = HFCheckpointReader(full), HFCheckpointReader(tmp_path / "back")
    assert sorted(back.names()) == sorted(source.names())
    assert all(torch.equal(back.get(name), source.get(name)) for name in source.names())
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == config
