"""Every shipped recipe loads and validates; bases type-check on their own."""

from pathlib import Path

import pytest

from rltrain.config import RLConfig, dump_yaml, load_config
from rltrain.config.loader import build_dataclass
from rltrain.config.recipe import read_recipe

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
SIDE_FILES = ("tools", "interactions")  # tools and interaction files the recipes name, not recipes
ALL = sorted(p for p in RECIPES.rglob("*.yaml") if p.relative_to(RECIPES).parts[0] not in SIDE_FILES)
BASES = [p for p in ALL if p.stem.endswith("_base")]
RUNNABLE = [p for p in ALL if p not in BASES]


def test_recipes_exist():
    names = {p.name for p in RUNNABLE}
    assert {"quickstart_cpu.yaml", "smollm2_135m_arith_cpu.yaml"} <= names
    assert len(RUNNABLE) >= 5


@pytest.mark.parametrize("path", RUNNABLE, ids=lambda p: str(p.relative_to(RECIPES)))
def test_recipe_loads_validates_and_round_trips(path, tmp_path):
    config = load_config(path)
    assert config.validate() == []
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(dump_yaml(config))
    assert load_config(dumped) == config


@pytest.mark.parametrize("path", BASES, ids=lambda p: str(p.relative_to(RECIPES)))
def test_base_recipe_keys_are_valid_and_used(path):
    build_dataclass(RLConfig, read_recipe(path))  # strict keys and types, no cross-field checks
    users = [p for p in RUNNABLE if f"base: {path.name}" in p.read_text()]
    assert users, f"{path.name} is not the base of any recipe"


def test_quickstart_is_cpu_sized():
    config = load_config(RECIPES / "quickstart_cpu.yaml")
    assert config.model.tiny is not None and config.model.dtype == "float32"
    assert config.cluster.world_size() == 1 and config.cluster.backend == "gloo"
    assert config.algorithm.use_kl_in_reward and config.critic_enabled()


def test_gpu_recipes_use_verl_published_sizes():
    small = load_config(RECIPES / "gpu" / "qwen2.5_0.5b_gsm8k_ppo.yaml")
    big = load_config(RECIPES / "gpu" / "qwen2.5_7b_gsm8k_ppo.yaml")
    assert (small.data.train_batch_size, small.actor.ppo_mini_batch_size) == (256, 64)
    assert (big.data.train_batch_size, big.actor.ppo_mini_batch_size) == (512, 128)
    for c in (small, big):
        assert (c.actor.optim.lr, c.critic.optim.lr, c.algorithm.kl_ctrl.kl_coef) == (1e-6, 1e-5, 0.001)
    moe = load_config(RECIPES / "gpu" / "qwen1.5_moe_a2.7b_gsm8k_grpo_ep.yaml")
    assert moe.actor.parallel.expert_model_parallel_size == 4
    # replay on, and uneven stages: 13 + 11 of Qwen1.5-MoE-A2.7B's 24 layers
    assert moe.actor.router_replay.mode == "R2" and not moe.actor.recompute_activations
    layout = moe.actor.parallel
    assert (layout.pipeline_model_parallel_size, layout.num_layers_in_last_pipeline_stage) == (2, 11)
    assert layout.num_layers_in_first_pipeline_stage is None
    from megatron_bridge.layout import chunk_layers

    stages = [
        chunk_layers(
            24,
            pp_rank=r,
            pp=2,
            first=layout.num_layers_in_first_pipeline_stage,
            last=layout.num_layers_in_last_pipeline_stage,
        )
        for r in (0, 1)
    ]
    assert stages == [range(0, 13), range(13, 24)]


def test_multi_turn_recipes_name_tool_and_interaction_files_that_load():
    from rltrain.agent.interactions import load_interaction
    from rltrain.agent.tools.registry import load_tool_config

    multi = [p for p in RUNNABLE if load_config(p).rollout.multi_turn.enable]
    assert {p.name for p in multi} >= {
        "calculator_multiturn_cpu.yaml",
        "smollm2_135m_multiturn_cpu.yaml",
        "qwen2.5_3b_gsm8k_python_tool_grpo.yaml",
    }
    root = RECIPES.parent
    for path in multi:
        cfg = load_config(path).rollout
        assert cfg.uses_async_engine(), path.name
        names = sorted(load_tool_config(root / cfg.multi_turn.tool_config_path).tools)
        assert names == (["python"] if "python" in path.name else ["calculator"]), path.name
        if cfg.multi_turn.interaction_config_path:
            assert load_interaction(root / cfg.multi_turn.interaction_config_path).name == "feedback"


def _one_node_moe_layout_fits(config, released, moe) -> int:
    """The actor's layout takes ``released`` (``validate_layout`` finds no problem) with its experts
    over every GPU of the node (EP × expert-TP = 8); returns the number of GPUs."""
    from rltrain.megatron.model_config import validate_layout

    layout = config.actor.parallel
    problems = validate_layout(released, layout, moe=moe)
    assert problems == []
    world = config.cluster.nnodes * config.cluster.n_gpus_per_node
    assert layout.expert_model_parallel_size * layout.expert_tensor_parallel_size == world == 8
    return world


def test_moonlight_recipe_layout_fits_the_released_checkpoint():
    """The DeepSeek-V3-architecture recipe against Moonlight's released config.json: the family takes
    it as it is (one expert group, rms_norm_eps 1e-5, no query latent) and the layout divides it."""
    from megatron_bridge.registry import get_family
    from tests.released import released_config

    config = load_config(RECIPES / "gpu" / "moonlight_16b_a3b_gsm8k_grpo.yaml")
    released = released_config("moonlight-16b-a3b-instruct")
    assert config.model.path == "moonshotai/Moonlight-16B-A3B-Instruct" and config.model.trust_remote_code
    facts = get_family(released["model_type"]).facts(released)
    assert (facts.moe.num_experts, facts.moe.top_k, facts.moe.dense_layers) == (64, 6, (0,))
    assert facts.mla.q_lora_rank is None and facts.mla.latent_norm_eps == 1e-6
    layout, world = config.actor.parallel, _one_node_moe_layout_fits(config, released, facts.moe)
    assert facts.moe.num_experts // layout.expert_model_parallel_size == 8  # whole experts per GPU
    assert world % config.rollout.tensor_model_parallel_size == 0
    assert config.actor.router_replay.mode == "R2"


def test_gpt_oss_recipe_layout_fits_the_released_checkpoint():
    """The gpt-oss-20b recipe against the released config.json: the family takes it, the heads, KV
    heads and sinks split over TP and the engine's TP, whole experts per GPU, one mini-batch a step."""
    from megatron_bridge.registry import get_family
    from tests.released import released_config

    config = load_config(RECIPES / "gpu" / "gpt_oss_20b_gsm8k_grpo.yaml")
    released = released_config("gpt-oss-20b")
    with pytest.raises(NotImplementedError, match=r"mxfp4.*dequantize first"):
        get_family(released["model_type"]).facts(released)
    released.pop("quantization_config")  # the bf16 export the recipe starts from has none
    facts = get_family(released["model_type"]).facts(released)
    assert (facts.moe.num_experts, facts.moe.top_k) == (32, 4)
    layout, world = config.actor.parallel, _one_node_moe_layout_fits(config, released, facts.moe)
    assert facts.moe.num_experts // layout.expert_model_parallel_size == 4
    engine_tp = config.rollout.tensor_model_parallel_size
    assert world % engine_tp == 0
    assert (
        released["num_attention_heads"] % engine_tp == 0 and released["num_key_value_heads"] % engine_tp == 0
    )
    assert config.actor.router_replay.mode == "R2" and not config.actor.recompute_activations
    assert config.actor.ppo_mini_batch_size == config.data.train_batch_size
    assert config.model.moe.moe_aux_loss_coeff == 0.0 and released["router_aux_loss_coef"] == 0.9
