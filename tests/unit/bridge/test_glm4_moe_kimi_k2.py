"""GLM-4.5 (``glm4_moe``) and Kimi-K2 (``kimi_k2``, DeepSeek-V3's family): the facts of their released
configs (``tests/released``) written out by hand, the refusals, and the two equivalences the
translation rests on, checked against transformers' own code: RoPE on the first half of each head
(GLM) is Megatron's non-interleaved partial rotary, and routing in a single expert group (``n_group:
1``) is ungrouped top-k."""

from __future__ import annotations

import json

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_bridge.bridge import Bridge
from megatron_bridge.family import ArchitectureFacts, MLAFacts, MoEFacts
from megatron_bridge.hf_config import load_hf_config
from megatron_bridge.registry import get_family
from rltrain.models.tiny import tiny_hf_config
from tests.released import released_config, save_released_model, shrunk_config


def _sigmoid_moe(experts: int, top_k: int, ffn: int, scaling: float) -> MoEFacts:
    return MoEFacts(
        num_experts=experts,
        top_k=top_k,
        ffn_hidden_size=ffn,
        renormalize_topk=True,
        aux_loss_coeff=0.0,
        shared_expert_ffn_hidden_size=ffn,
        dense_layers=(0,),
        score_function="sigmoid",
        num_groups=None,
        group_topk=None,
        topk_scaling_factor=scaling,
        expert_bias=True,
    )


def test_glm_4_5_air_released_config_gives_its_architecture():
    # 96 heads / 8 KV heads of 128 with Q/K/V biases and no q/k norm, RoPE on 64 of 128 dims; layer 0
    # dense, then top-8 of 128 experts (one group), shared expert 1408, routed_scaling_factor 1.0
    expected = ArchitectureFacts(
        qkv_bias=True,
        qk_norm=False,
        tie_word_embeddings=False,
        moe=_sigmoid_moe(128, 8, 1408, 1.0),
        rotary_fraction=0.5,
        mtp_num_layers=1,
    )
    family = get_family("glm4_moe")
    assert family.facts(released_config("glm-4.5-air")) == expected
    from transformers import Glm4MoeConfig

    # transformers' reading of the file (partial_rotary_factor moved into rope_parameters)
    assert family.facts(Glm4MoeConfig.from_dict(released_config("glm-4.5-air"))) == expected


def test_glm4_moe_refusals_name_the_key():
    family = get_family("glm4_moe")
    for overrides, error, message in [
        ({"norm_topk_prob": False}, NotImplementedError, r"glm4_moe: norm_topk_prob=false"),
        (
            {"n_group": 2, "topk_group": 2, "num_experts_per_tok": 2},
            NotImplementedError,
            r"glm4_moe: num_experts_per_tok=2 / topk_group=2 must be 2",
        ),
        ({"n_group": 1, "topk_group": 2}, ValueError, r"glm4_moe: topk_group=2 exceeds n_group=1"),
    ]:
        with pytest.raises(error, match=message):
            family.facts(tiny_hf_config("glm4_moe", vocab_size=448, **overrides))
    # two groups of two experts, top-2 from one group: HF's and Megatron's group scores agree
    grouped = family.facts(tiny_hf_config("glm4_moe", vocab_size=448, n_group=2, topk_group=1))
    assert (grouped.moe.num_groups, grouped.moe.group_topk) == (2, 1)


def test_glm4_moe_qk_norm_rows_follow_use_qk_norm():
    def norm_rows(use_qk_norm: bool) -> list[tuple[str, str]]:
        config = tiny_hf_config("glm4_moe", vocab_size=448, use_qk_norm=use_qk_norm).to_dict()
        bridge = Bridge.from_hf_config(config)
        return [
            (u.megatron_names[0], u.hf_names[0])
            for u in bridge.units
            if "layernorm" in u.megatron_names[0] and ".layers.0.self_attention." in u.megatron_names[0]
        ]

    assert norm_rows(True) == [
        ("decoder.layers.0.self_attention.q_layernorm.weight", "model.layers.0.self_attn.q_norm.weight"),
        ("decoder.layers.0.self_attention.k_layernorm.weight", "model.layers.0.self_attn.k_norm.weight"),
    ]
    assert norm_rows(False) == []


def test_glm_mtp_layer_maps_to_megatrons_mtp_and_is_never_dropped(tmp_path):
    """GLM-4.5-Air's checkpoint holds its MTP layer as layer ``num_hidden_layers`` (46): a decoder
    layer, enorm / hnorm / eh_proj / shared_head.norm and its own embed_tokens copy, no head copy.
    transformers drops it on load; the bridge maps every tensor to Megatron's ``mtp.layers.0`` and
    names any that is missing."""
    from safetensors.torch import load_file

    from rltrain.models.tiny import add_mtp_layers

    src = save_released_model(tmp_path / "hf", "glm-4.5-air")
    config = json.loads((src / "config.json").read_text())
    added = add_mtp_layers(src)
    mtp = f"model.layers.{config['num_hidden_layers']}."
    assert {n.removeprefix(mtp) for n in added} >= {"eh_proj.weight", "enorm.weight", "embed_tokens.weight"}
    assert f"{mtp}shared_head.head.weight" not in added and f"{mtp}self_attn.q_proj.bias" in added
    state = load_file(src / "model.safetensors")
    megatron = dict(Bridge.from_hf_config(config).hf_to_megatron(dict(state)))
    assert torch.equal(megatron["mtp.layers.0.eh_proj.weight"], state[f"{mtp}eh_proj.weight"])
    assert torch.equal(
        megatron["mtp.layers.0.final_layernorm.weight"], state[f"{mtp}shared_head.norm.weight"]
    )
    del state[f"{mtp}eh_proj.weight"]
    with pytest.raises(KeyError, match=rf"{mtp}eh_proj\.weight"):
        dict(Bridge.from_hf_config(config).hf_to_megatron(state))


def test_partial_rope_of_transformers_is_megatrons_rotary_percent():
    """GLM's RoPE (transformers' Glm4Moe rotary embedding and ``apply_rotary_pos_emb``) on 32-dim
    heads with partial_rotary_factor 0.5 against Megatron's RotaryEmbedding(rotary_percent=0.5) and its
    unfused rotation, non-interleaved: the same inverse frequencies bit for bit, the same rotated
    queries to fp32 rounding, and the second half of each head untouched by both."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe import modeling_glm4_moe as glm

    seq, heads, dim, base = 40, 4, 32, 1e6
    hf_config = Glm4MoeConfig(
        hidden_size=heads * dim, num_attention_heads=heads, head_dim=dim, partial_rotary_factor=0.5,
        rope_parameters={"rope_type": "default", "rope_theta": base, "partial_rotary_factor": 0.5},
    )  # fmt: skip
    hf_rope = glm.Glm4MoeRotaryEmbedding(hf_config)
    mcore_rope = RotaryEmbedding(
        kv_channels=dim, rotary_percent=0.5, rotary_base=base, use_cpu_initialization=True
    )
    assert torch.equal(hf_rope.inv_freq, mcore_rope.inv_freq)
    q = torch.randn(1, heads, seq, dim, generator=torch.Generator().manual_seed(0))
    cos, sin = hf_rope(q, torch.arange(seq)[None])
    hf_q, _ = glm.apply_rotary_pos_emb(q, q, cos, sin)
    # Megatron's table as its forward builds it ([seq, 1, 1, dim / 2], non-interleaved; the forward
    # itself moves the table to CUDA)
    half = mcore_rope.get_freqs_non_repeated(seq)
    freqs = torch.cat((half, half), dim=-1)[:, None, None, :]
    # Megatron's unfused [seq, batch, heads, dim] rotation (what apply_rotary_pos_emb calls without CP)
    mcore_q = rope_utils._apply_rotary_pos_emb_bshd(q[0].transpose(0, 1)[:, None], freqs)[:, 0]
    mcore_q = mcore_q.transpose(0, 1)[None]
    assert float((hf_q - mcore_q).abs().max()) < 1e-6
    assert torch.equal(hf_q[..., dim // 2 :], q[..., dim // 2 :])
    assert torch.equal(mcore_q[..., dim // 2 :], q[..., dim // 2 :])
    assert float((hf_q[..., : dim // 2] - q[..., : dim // 2]).abs().max()) > 0.1  # it did rotate


def test_a_single_expert_group_routes_as_ungrouped_top_k():
    """transformers' group-limited router with ``n_group: 1, topk_group: 1`` (Kimi-K2, GLM-4.5)
    chooses the top-k of ``sigmoid + bias`` over all experts and weighs them by the renormalized
    unbiased scores times ``routed_scaling_factor``: what Megatron's ungrouped sigmoid router
    computes, derived here by hand."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(
        hidden_size=16, n_routed_experts=16, num_experts_per_tok=8, n_group=1, topk_group=1,
        routed_scaling_factor=2.827, norm_topk_prob=True,
    )  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(0)
    router.weight.data = torch.randn(16, 16, generator=gen)
    router.e_score_correction_bias.data = torch.randn(16, generator=gen) * 0.3
    x = torch.randn(64, 16, generator=gen)
    out = router(x)
    hf_weights, hf_indices = out[-2], out[-1]
    scores = torch.sigmoid(x @ router.weight.T)
    indices = torch.topk(scores + router.e_score_correction_bias, 8, dim=-1).indices
    weights = scores.gather(1, indices)
    weights = weights / weights.sum(-1, keepdim=True) * 2.827
    order = hf_indices.argsort(-1)
    hf_sorted, hf_w = hf_indices.gather(1, order), hf_weights.gather(1, order)
    mine_order = indices.argsort(-1)
    assert torch.equal(hf_sorted, indices.gather(1, mine_order))
    assert float((hf_w - weights.gather(1, mine_order)).abs().max()) < 1e-6


def test_kimi_k2_released_config_is_deepseek_v3_ungrouped(tmp_path):
    """Kimi-K2-Instruct: MLA as DeepSeek-V3, layer 0 dense, top-8 of 384 experts in a single group,
    scaled by 2.827, YaRN with factor 32 (beta_fast = beta_slow = 1) built as MLA's YaRN."""
    released = released_config("kimi-k2-instruct")
    assert released["model_type"] == "kimi_k2" and released["architectures"] == ["DeepseekV3ForCausalLM"]
    expected = ArchitectureFacts(
        qkv_bias=False,
        qk_norm=False,
        tie_word_embeddings=False,
        moe=_sigmoid_moe(384, 8, 2048, 2.827),
        mla=MLAFacts(
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
        ),
    )
    assert get_family("kimi_k2") is get_family("deepseek_v3")
    assert get_family("kimi_k2").facts(released) == expected
    # The saved tiny checkpoint says kimi_k2, as the real one; it loads as transformers' DeepseekV3Config.
    src = save_released_model(tmp_path / "hf", "kimi-k2-instruct")
    assert json.loads((src / "config.json").read_text())["model_type"] == "kimi_k2"
    hf = load_hf_config(src)
    assert type(hf).__name__ == "DeepseekV3Config" and hf.model_type == "deepseek_v3"
    shrunk = shrunk_config("kimi-k2-instruct")
    assert get_family("kimi_k2").facts(hf) == get_family("kimi_k2").facts(shrunk)
    from rltrain.config.parallel import ParallelConfig
    from rltrain.megatron.model_config import transformer_config_from_hf

    config = transformer_config_from_hf(hf, parallel=ParallelConfig(), params_dtype=torch.float32)
    assert config.rope_type == "yarn" and config.rotary_scaling_factor == 32.0
    assert (config.beta_fast, config.beta_slow, config.original_max_position_embeddings) == (1.0, 1.0, 16)
