"""Model families: each family file registers one object whose architecture facts, read from its tiny
preset and from released configs, equal hand-written values (the facts the Megatron builder uses)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import megatron_bridge.models
from megatron_bridge.family import ArchitectureFacts, MLAFacts, ModelFamily, MoEFacts
from megatron_bridge.models.common import dense_layers
from megatron_bridge.registry import family_types, get_family, supported_model_types
from rltrain.models.tiny import tiny_hf_config


def _facts(qkv_bias: bool, qk_norm: bool, tied: bool, moe: MoEFacts | None = None) -> ArchitectureFacts:
    return ArchitectureFacts(qkv_bias=qkv_bias, qk_norm=qk_norm, tie_word_embeddings=tied, moe=moe)


def _moe(
    num_experts: int,
    top_k: int,
    ffn: int,
    renormalize: bool,
    aux: float,
    *,
    shared: int = 0,
    gate: bool = False,
) -> MoEFacts:
    return MoEFacts(
        num_experts=num_experts,
        top_k=top_k,
        ffn_hidden_size=ffn,
        renormalize_topk=renormalize,
        aux_loss_coeff=aux,
        shared_expert_ffn_hidden_size=shared,
        shared_expert_gate=gate,
    )


# The architecture of each family's tiny test model, written out by hand:
# (qkv_bias, qk_norm, tied, experts (num, top-k, ffn, renormalized top-k, aux loss, shared expert)).
TINY_FACTS = {
    "llama": _facts(False, False, False),
    "qwen2": _facts(True, False, True),
    "qwen3": _facts(False, True, True),
    "mixtral": _facts(False, False, False, _moe(4, 2, 128, True, 0.01)),
    "qwen2_moe": _facts(True, False, False, _moe(4, 2, 128, False, 0.001, shared=128, gate=True)),
    "qwen3_moe": _facts(False, True, False, _moe(4, 2, 128, True, 0.001)),
    # one dense layer then two MoE layers; softmax routing limited to 2 of 3 groups, not renormalized
    "deepseek_v2": ArchitectureFacts(
        qkv_bias=False,
        qk_norm=False,
        tie_word_embeddings=False,
        moe=MoEFacts(
            num_experts=6,
            top_k=2,
            ffn_hidden_size=32,
            renormalize_topk=False,
            aux_loss_coeff=0.0,
            shared_expert_ffn_hidden_size=32,
            dense_layers=(0,),
            score_function="softmax",
            num_groups=3,
            group_topk=2,
            topk_scaling_factor=2.0,
            expert_bias=False,
        ),
        mla=MLAFacts(
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32
        ),
    ),
    "deepseek_v3": ArchitectureFacts(
        qkv_bias=False,
        qk_norm=False,
        tie_word_embeddings=False,
        moe=MoEFacts(
            num_experts=4,
            top_k=2,
            ffn_hidden_size=32,
            renormalize_topk=True,
            aux_loss_coeff=0.0,
            shared_expert_ffn_hidden_size=32,
            dense_layers=(0, 1),
            score_function="sigmoid",
            num_groups=2,
            group_topk=1,
            topk_scaling_factor=2.5,
            expert_bias=True,
        ),
        mla=MLAFacts(
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32
        ),
    ),
    # GLM-4.5: GQA with Q/K/V biases and q/k norms, RoPE on half of each head; one dense layer then
    # two MoE layers, sigmoid top-2 of 4 experts in one group (ungrouped) with the expert bias
    "glm4_moe": ArchitectureFacts(
        qkv_bias=True,
        qk_norm=True,
        tie_word_embeddings=False,
        moe=MoEFacts(
            num_experts=4,
            top_k=2,
            ffn_hidden_size=64,
            renormalize_topk=True,
            aux_loss_coeff=0.0,
            shared_expert_ffn_hidden_size=64,
            dense_layers=(0,),
            score_function="sigmoid",
            num_groups=None,
            group_topk=None,
            topk_scaling_factor=2.5,
            expert_bias=True,
        ),
        rotary_fraction=0.5,
    ),
    # GPT-OSS: biases on every linear and the router, sinks, layer 0 sliding (8 keys), layer 1 full;
    # top-2 of 4 biased experts, softmax over the top 2, the GLU clamped at 7
    "gpt_oss": ArchitectureFacts(
        qkv_bias=True,
        qk_norm=False,
        tie_word_embeddings=False,
        moe=MoEFacts(
            num_experts=4,
            top_k=2,
            ffn_hidden_size=128,
            renormalize_topk=True,
            aux_loss_coeff=0.01,
            biased_experts=True,
        ),
        sliding_window=8,
        sliding_layers=(0,),
        linear_bias=True,
        attention_sinks=True,
        clamped_glu_limit=7.0,
    ),
}


def test_every_family_file_registers_its_family():
    files = {m.name for m in pkgutil.iter_modules(megatron_bridge.models.__path__)} - {"common"}
    assert files == {
        "deepseek_v2",
        "deepseek_v3",
        "glm4_moe",
        "gpt_oss",
        "llama",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
    }
    assert family_types() == sorted(files)
    # Kimi-K2's checkpoints (model_type kimi_k2) are DeepSeek-V3's family
    assert supported_model_types() == sorted(files | {"kimi_k2"})
    for name in files:
        module = importlib.import_module(f"megatron_bridge.models.{name}")
        (family,) = [v for v in vars(module).values() if isinstance(v, ModelFamily)]
        assert family.model_types[0] == name and get_family(name) is family
        assert all(get_family(alias) is family for alias in family.model_types)
    assert get_family("deepseek_v3").model_types == ("deepseek_v3", "kimi_k2")


@pytest.mark.parametrize("model_type", sorted(TINY_FACTS))
def test_tiny_preset_facts_are_the_hand_written_ones(model_type):
    family = get_family(model_type)
    config = tiny_hf_config(model_type, vocab_size=448)
    assert config.model_type == model_type
    assert family.facts(config) == TINY_FACTS[model_type]
    # The bridge reads config.json as a dict: the same facts.
    assert family.facts(config.to_dict()) == TINY_FACTS[model_type]


def test_released_config_defaults_give_the_released_architectures():
    from transformers import LlamaConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    qwen2_moe = get_family("qwen2_moe").facts(Qwen2MoeConfig())  # Qwen1.5-MoE-A2.7B
    assert qwen2_moe == _facts(True, False, False, _moe(60, 4, 1408, False, 0.001, shared=5632, gate=True))
    qwen3_moe = get_family("qwen3_moe").facts(Qwen3MoeConfig(norm_topk_prob=True))  # Qwen3-30B-A3B
    assert qwen3_moe == _facts(False, True, False, _moe(128, 8, 768, True, 0.001))
    mixtral = get_family("mixtral").facts(MixtralConfig())  # Mixtral-8x7B
    assert mixtral == _facts(False, False, False, _moe(8, 2, 14336, True, 0.001))
    llama = get_family("llama").facts(LlamaConfig(attention_bias=True, tie_word_embeddings=True))
    assert llama == _facts(True, False, True)
    assert get_family("qwen2").facts({"tie_word_embeddings": False}).qkv_bias  # no switch: always biased


def test_deepseek_v3_released_config_and_refusals():
    from transformers import DeepseekV3Config

    facts = get_family("deepseek_v3").facts(DeepseekV3Config())  # DeepSeek-V3 (671B)
    assert facts.moe.dense_layers == (0, 1, 2) and facts.moe.num_experts == 256 and facts.moe.top_k == 8
    assert (facts.moe.num_groups, facts.moe.group_topk, facts.moe.topk_scaling_factor) == (8, 4, 2.5)
    assert facts.moe.shared_expert_ffn_hidden_size == 2048
    assert facts.mla == MLAFacts(1536, 512, 128, 64, 128)
    family = get_family("deepseek_v3")
    for overrides, message in [
        ({"topk_group": 2}, r"deepseek_v3: num_experts_per_tok=2 / topk_group=2 must be 2"),
        ({"norm_topk_prob": False}, r"deepseek_v3: norm_topk_prob=false"),
        ({"rope_interleave": False}, r"deepseek_v3: rope_interleave=false"),
    ]:
        with pytest.raises(NotImplementedError, match=message):
            family.facts(tiny_hf_config("deepseek_v3", vocab_size=448, **overrides))


def test_deepseek_v2_released_config_and_refusals():
    from transformers import DeepseekV2Config

    # DeepSeek-V2 (236B): 160 experts, top-6 of 3 groups out of 8; Megatron scores a group by the sum
    # of its top 6/3 experts, HF by its best one
    with pytest.raises(NotImplementedError, match=r"num_experts_per_tok=6 != topk_group=3"):
        get_family("deepseek_v2").facts(
            DeepseekV2Config(
                n_routed_experts=160,
                num_experts_per_tok=6,
                topk_method="group_limited_greedy",
                n_group=8,
                topk_group=3,
            )
        )
    # greedy top-6 of 64 experts, 2 shared, the first layer dense (DeepSeek-V2-Lite's routing)
    facts = get_family("deepseek_v2").facts(DeepseekV2Config(num_experts_per_tok=6, first_k_dense_replace=1))
    assert (facts.moe.num_experts, facts.moe.top_k, facts.moe.num_groups, facts.moe.group_topk) == (
        64,
        6,
        None,
        None,
    )
    assert facts.moe.dense_layers == (0,) and facts.moe.shared_expert_ffn_hidden_size == 2 * 1407
    assert (
        not facts.moe.renormalize_topk and not facts.moe.expert_bias and facts.moe.score_function == "softmax"
    )
    assert facts.mla == MLAFacts(1536, 512, 128, 64, 128)
    lite = DeepseekV2Config(q_lora_rank=None, num_experts_per_tok=6, first_k_dense_replace=1)
    assert get_family("deepseek_v2").facts(lite).mla == MLAFacts(None, 512, 128, 64, 128)  # V2-Lite
    family = get_family("deepseek_v2")
    for overrides, message in [
        ({"topk_method": "noaux_tc"}, r"deepseek_v2: topk_method='noaux_tc' is not supported"),
        ({"scoring_func": "sigmoid"}, r"deepseek_v2: scoring_func='sigmoid'"),
        ({"norm_topk_prob": True}, r"deepseek_v2: norm_topk_prob=true"),
    ]:
        with pytest.raises(NotImplementedError, match=message):
            family.facts(tiny_hf_config("deepseek_v2", vocab_size=448, **overrides))


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_mla_latent_norms_keep_transformers_eps_whatever_rms_norm_eps_says(model_type):
    # transformers builds q_a_layernorm / kv_a_layernorm without eps: its RMSNorm's default 1e-6
    import inspect

    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(model_type, vocab_size=448, rms_norm_eps=1e-5)  # Moonlight's eps
    model = AutoModelForCausalLM.from_config(config)
    attention = model.model.layers[0].self_attn
    assert attention.kv_a_layernorm.variance_epsilon == attention.q_a_layernorm.variance_epsilon == 1e-6
    assert model.model.layers[0].input_layernorm.variance_epsilon == 1e-5
    assert inspect.signature(type(attention.kv_a_layernorm)).parameters["eps"].default == 1e-6
    facts = get_family(model_type).facts(config)
    assert facts.mla.latent_norm_eps == 1e-6


def test_dense_layers_follow_hf_sparse_step_and_mlp_only_layers():
    assert dense_layers({"num_hidden_layers": 4}) == ()
    assert dense_layers({"num_hidden_layers": 4, "decoder_sparse_step": 2}) == (0, 2)
    assert dense_layers({"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}) == (
        0,
        2,
        3,
    )
    assert dense_layers({"num_hidden_layers": 4, "mlp_only_layers": [1]}) == (1,)
    with pytest.raises(ValueError, match=r"decoder_sparse_step=0"):
        dense_layers({"num_hidden_layers": 4, "decoder_sparse_step": 0})


def test_a_config_without_experts_is_dense():
    facts = get_family("qwen2_moe").facts({"num_experts": 0, "num_hidden_layers": 2})
    assert facts.moe is None


def test_tiny_preset_is_read_only_and_unknown_types_are_named():
    with pytest.raises(TypeError):
        get_family("llama").tiny_preset["hidden_size"] = 1  # type: ignore[index]
    with pytest.raises(
        ValueError,
        match=r"no tiny preset for model_type='gpt_neox'; known: \['deepseek_v2', 'deepseek_v3', 'glm4_moe', 'gpt_oss', 'llama'",
    ):
        tiny_hf_config("gpt_neox", vocab_size=64)


def _compares_model_type_to_a_literal(node: ast.Compare) -> bool:
    sides = [node.left, *node.comparators]

    def is_model_type(n: ast.AST) -> bool:
        return (isinstance(n, ast.Name) and n.id == "model_type") or (
            isinstance(n, ast.Attribute) and n.attr == "model_type"
        )

    def is_literal(n: ast.AST) -> bool:
        if isinstance(n, (ast.Tuple, ast.List, ast.Set)):
            return all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in n.elts)
        return isinstance(n, ast.Constant) and isinstance(n.value, str)

    return any(map(is_model_type, sides)) and any(map(is_literal, sides))


def test_no_code_outside_the_family_files_branches_on_a_model_type_literal():
    root = Path(__file__).resolve().parents[3]
    family_dir = root / "megatron_bridge" / "models"
    offenders = []
    for path in sorted([*root.glob("rltrain/**/*.py"), *root.glob("megatron_bridge/**/*.py")]):
        if family_dir in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Compare) and _compares_model_type_to_a_literal(node):
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not offenders, f"model_type compared to a literal outside megatron_bridge/models/: {offenders}"


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_mla_query_rows_follow_q_lora_rank(model_type):
    """With a query latent the bridge maps q_a_proj / q_a_layernorm / q_b_proj; without one
    (``q_lora_rank: null``, DeepSeek-V2-Lite) the one q_proj, Megatron's linear_q_proj, split by heads."""
    from megatron_bridge.bridge import Bridge

    def attention_rows(**overrides):
        bridge = Bridge.from_hf_config(tiny_hf_config(model_type, vocab_size=448, **overrides), tp_size=2)
        return sorted(
            (u.megatron_names[0].split(".")[-2], u.hf_names[0].split(".")[-2], u.mapping.tp_dim)
            for u in bridge.units
            if ".layers.0.self_attention.linear_q" in u.megatron_names[0]
            or ".layers.0.self_attention.q_layernorm" in u.megatron_names[0]
        )

    assert attention_rows() == [
        ("linear_q_down_proj", "q_a_proj", 0),
        ("linear_q_up_proj", "q_b_proj", 0),
        ("q_layernorm", "q_a_layernorm", None),
    ]
    assert attention_rows(q_lora_rank=None) == [("linear_q_proj", "q_proj", 0)]
