"""GLM-4.5-Air and Kimi-K2-Instruct (their released config.json, shrunk: ``tests/released``) through
``rltrain convert`` at the layouts their checkpoints are trained at, scaled down: experts over EP=2
and two pipeline stages. Each conversion compares Megatron's fp32 logits with transformers' on the
same weights (Kimi-K2: transformers' DeepseekV3, which reads its config.json) and comes back to HF
bit for bit."""

from __future__ import annotations

import pytest
import torch

from megatron_bridge.hf_io import HFCheckpointReader
from rltrain.convert.launch import run_conversion
from rltrain.models.tiny import add_mtp_layers, randomize_expert_bias, save_tiny_model
from tests.released import save_released_model

pytestmark = pytest.mark.dist


@pytest.mark.parametrize(
    ("name", "overrides", "tp", "pp", "ep"),
    [
        # 1 dense + 3 MoE layers over two stages, GQA with Q/K/V biases, RoPE on half of each head,
        # sigmoid routing with a nonzero expert bias, shared expert
        ("glm-4.5-air", {}, 1, 2, 2),
        # MLA; 1 dense + 3 MoE layers, top-8 of 16 experts in one group (ungrouped), scaled by 2.827
        ("kimi-k2-instruct", {}, 1, 2, 2),
    ],
)
@pytest.mark.supports("glm4_moe", "conversion", "pp", "ep", "mtp", "hf_parity")
@pytest.mark.supports("deepseek_v3", "yarn")
def test_released_moe_converts_bit_exact_and_matches_transformers(tmp_path, name, overrides, tp, pp, ep):
    src = save_released_model(tmp_path / "hf", name, seed=1, **overrides)
    add_mtp_layers(src)  # GLM-4.5-Air's MTP layer (layer 4 here), as released: converted with the rest
    check_round_trip(tmp_path, src, tp=tp, pp=pp, ep=ep)


@pytest.mark.supports("glm4_moe", "conversion", "tp", "ep")
def test_glm_4_5_with_qk_norm_converts_bit_exact_at_tp2_ep2(tmp_path):
    """GLM-4.5 / GLM-4.6's attention (``use_qk_norm``: per-head q/k norms; the tiny preset) with the
    QKV weights and biases split over TP=2 and the experts over EP=2."""
    src = save_tiny_model(tmp_path / "hf", "glm4_moe", seed=2)
    assert "model.layers.0.self_attn.q_norm.weight" in HFCheckpointReader(src).names()
    check_round_trip(tmp_path, src, tp=2, pp=1, ep=2)


def check_round_trip(tmp_path, src, *, tp: int, pp: int, ep: int) -> None:
    randomize_expert_bias(src)  # the bias decides the routing: a wrong sign or a missed bias shows
    to_mcore = run_conversion("hf-to-mcore", src, tmp_path / "mcore", tp=tp, pp=pp, ep=ep, atol=1e-4)
    print(to_mcore.summary())
    names = HFCheckpointReader(src).names()
    assert to_mcore.bit_exact_tensors == len(names)
    assert to_mcore.max_abs_logit_diff <= 1e-5  # Megatron at (tp, pp, ep) vs transformers, fp32
    run_conversion("mcore-to-hf", tmp_path / "mcore", tmp_path / "back", verify=False)
    back = HFCheckpointReader(tmp_path / "back")
    assert sorted(back.names()) == sorted(names)
    reader = HFCheckpointReader(src)
    for tensor in names:
        assert torch.equal(reader.get(tensor), back.get(tensor)), tensor
    assert (tmp_path / "back" / "config.json").read_bytes() == (src / "config.json").read_bytes()
