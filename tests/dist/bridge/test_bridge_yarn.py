"""Conversion of the released YaRN checkpoints (tests/released: Qwen3-8B with its model card's YaRN
block, DeepSeek-V3), shrunk: bit-exact both ways at a layout the real checkpoint would use, scaled
(Qwen3-8B: TP=2; DeepSeek-V3: EP=2 × PP=2), verified against transformers on probe rows reaching past
``original_max_position_embeddings`` (``probe_tokens``); and a conversion whose config lost or changed
its YaRN block fails the default verification and leaves nothing behind."""

from __future__ import annotations

import re

import bridge_ranks
import pytest
from test_bridge_conversion import _assert_same_checkpoint
from transformers import AutoConfig

from megatron_bridge.verify import PROBE_TOKENS, probe_tokens
from rltrain.convert import launch
from rltrain.convert.launch import run_conversion
from rltrain.convert.report import ConversionError
from rltrain.models.tiny import add_mtp_layers, randomize_expert_bias
from tests.released import save_released_model

pytestmark = pytest.mark.dist


def _save(tmp_path, name: str):
    src = save_released_model(tmp_path / "hf", name, initializer_range=0.1)
    if name == "deepseek-v3":
        randomize_expert_bias(src)  # the bias decides the routing: a nonzero one must survive the trip
        add_mtp_layers(src)  # its released MTP layer, whose logits the conversion checks under YaRN too
    return src


@pytest.mark.parametrize(
    ("name", "layout"),
    [("qwen3-8b-yarn", dict(tp=2)), ("deepseek-v3", dict(pp=2, ep=2))],
    ids=["qwen3-8b-yarn-tp2", "deepseek-v3-pp2-ep2"],
)
@pytest.mark.supports("qwen3", "yarn", "conversion", "tp")
@pytest.mark.supports("deepseek_v3", "yarn", "mtp")
def test_released_yarn_checkpoints_convert_bit_exact_both_ways(tmp_path, name, layout):
    src = _save(tmp_path, name)
    config = AutoConfig.from_pretrained(src)
    tokens = probe_tokens(config)
    assert tokens > config.rope_parameters["original_max_position_embeddings"]
    to_mcore = run_conversion("hf-to-mcore", src, tmp_path / "mcore", atol=1e-4, **layout)
    print(to_mcore.summary())
    assert to_mcore.max_abs_logit_diff <= 1e-5  # fp32 Megatron at the layout vs transformers
    assert f"on 2×{tokens} tokens" in to_mcore.logits_check
    back = run_conversion("mcore-to-hf", tmp_path / "mcore", tmp_path / "back", atol=1e-4)
    assert back.max_abs_logit_diff <= 1e-5
    _assert_same_checkpoint(src, tmp_path / "back")
    assert (tmp_path / "back" / "config.json").read_bytes() == (src / "config.json").read_bytes()


@pytest.mark.parametrize(
    ("name", "entry"),
    [
        ("qwen3-8b-yarn", bridge_ranks.entry_with_yarn_dropped),
        ("qwen3-8b-yarn", bridge_ranks.entry_with_yarn_factor_halved),
        ("deepseek-v3", bridge_ranks.entry_with_yarn_mscale_all_dim_dropped),
    ],
    ids=["qwen3-dropped", "qwen3-factor-halved", "deepseek-v3-mscale-all-dim-dropped"],
)
def test_a_conversion_that_loses_or_changes_yarn_fails_verification(tmp_path, monkeypatch, name, entry):
    src = _save(tmp_path, name)
    monkeypatch.setattr(launch, "_entry", entry)
    dst = tmp_path / "mcore"
    with pytest.raises(ConversionError) as failed:
        run_conversion("hf-to-mcore", src, dst)
    found = re.fullmatch(
        r"rank 0: the converted model's logits vs transformers, both in float32 on 2×(\d+) tokens: "
        rf"max abs diff (\S+) > (?:atol|tolerance) (\S+)(?: \(.*\))?; nothing was written to {dst}",
        str(failed.value),
    )
    assert found, str(failed.value)
    assert int(found.group(1)) == probe_tokens(AutoConfig.from_pretrained(src))
    assert float(found.group(2)) > 10 * float(found.group(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_the_probe_reaches_past_yarns_original_length() -> None:
    """Past the original length, capped at the context; PROBE_TOKENS without YaRN."""
    from transformers import Qwen3Config

    def tokens(rope, context):
        return probe_tokens(Qwen3Config(max_position_embeddings=context, rope_parameters=rope))

    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    assert tokens({**yarn, "original_max_position_embeddings": 1024}, 4096) == 1024 + 32
    assert tokens({**yarn, "original_max_position_embeddings": 16}, 4096) == PROBE_TOKENS
    assert tokens({**yarn, "original_max_position_embeddings": 1024}, 1040) == 1040
    assert tokens({"rope_type": "default", "rope_theta": 1e6}, 4096) == PROBE_TOKENS
