"""Cross-field checks: batch arithmetic, parallel layout against devices, incompatible switches."""

import pytest

from rltrain.config import ConfigError, load_config

from .recipe_helpers import MINIMAL, write


def problems(tmp_path, overrides):
    path = write(tmp_path, "r.yaml", MINIMAL)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value.problems


def test_train_batch_must_be_multiple_of_mini_batch(tmp_path):
    assert problems(tmp_path, ["data.train_batch_size=10"]) == [
        "data.train_batch_size=10 is not a multiple of actor.ppo_mini_batch_size=4",
        "data.train_batch_size=10 is not a multiple of critic.ppo_mini_batch_size=4",
    ]


def test_mini_batch_must_split_over_dp_and_micro_batches(tmp_path):
    # 4 prompts × n=3 = 12 samples over DP=8 ranks
    found = problems(
        tmp_path,
        ["rollout.n=3", "cluster.n_gpus_per_node=8", "critic.enable=null", "algorithm.adv_estimator=grpo"],
    )
    assert found == [
        "actor.ppo_mini_batch_size × rollout.n = 4×3 = 12 samples do not split over the 8 data-parallel ranks of the actor"
    ]
    found = problems(tmp_path, ["actor.ppo_micro_batch_size_per_gpu=3"])
    assert found == [
        "4 samples per rank per mini-batch (actor.ppo_mini_batch_size × rollout.n / DP) is not a multiple of actor.ppo_micro_batch_size_per_gpu=3"
    ]


def test_parallel_layout_must_fit_devices(tmp_path):
    found = problems(tmp_path, ["cluster.n_gpus_per_node=6", "actor.parallel.tensor_model_parallel_size=4"])
    assert "actor.parallel: TP×PP×CP = 4×1×1 = 4 does not divide the 6 devices given to the role" in found
    found = problems(tmp_path, ["cluster.n_gpus_per_node=4", "actor.parallel.expert_model_parallel_size=3"])
    assert any(
        "expert_model_parallel_size × expert_tensor_parallel_size = 3×1 does not divide DP×CP×TP = 4" in p
        for p in found
    )
    found = problems(tmp_path, ["rollout.tensor_model_parallel_size=2"])
    assert (
        "rollout.tensor_model_parallel_size=2 does not divide the 1 devices (cluster.nnodes × cluster.n_gpus_per_node)"
        in found
    )


def test_incompatible_switches_are_named(tmp_path):
    assert problems(tmp_path, ["algorithm.adv_estimator=grpo"]) == [
        "algorithm.adv_estimator=grpo compares samples of one prompt: needs rollout.n >= 2, got 1"
    ]
    assert problems(tmp_path, ["critic.enable=false"]) == [
        "algorithm.adv_estimator=gae needs values: critic.enable=false is incompatible"
    ]
    assert problems(tmp_path, ["algorithm.kl_ctrl.type=adaptive"]) == [
        "algorithm.kl_ctrl.type=adaptive has no effect without algorithm.use_kl_in_reward=true"
    ]
    assert problems(tmp_path, ["model.path=/x"]) == [
        "set exactly one of model.path, model.gguf_package, model.tiny (given: model.path, model.tiny)"
    ]
    assert problems(tmp_path, ["actor.clip_ratio_c=1.0"]) == [
        "actor.clip_ratio_c must be > 1 (dual-clip bound), got 1.0"
    ]


def test_dynamic_bsz_budget_must_hold_one_sequence(tmp_path):
    found = problems(
        tmp_path,
        [
            "actor.use_dynamic_bsz=true",
            "actor.ppo_max_token_len_per_gpu=100",
            "data.max_prompt_length=64",
            "rollout.response_length=64",
        ],
    )
    assert found == [
        "actor.ppo_max_token_len_per_gpu=100 is smaller than one sequence (data.max_prompt_length + rollout.response_length = 128)"
    ]


def test_valid_group_estimator_without_critic(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL)
    config = load_config(path, ["algorithm.adv_estimator=grpo", "rollout.n=4"])
    assert not config.critic_enabled()


def test_rollout_mode_and_transport_must_agree(tmp_path):
    assert problems(tmp_path, ["rollout.mode=separate"]) == [
        "rollout.mode=separate needs rollout.num_devices, a multiple of rollout.tensor_model_parallel_size=1; got 0"
    ]
    assert problems(
        tmp_path,
        ["rollout.mode=separate", "rollout.num_devices=1", "rollout.weight_sync.transport=in_process"],
    ) == [
        "rollout.weight_sync.transport=in_process cannot reach engines on other devices (rollout.mode=separate); use broadcast or auto"
    ]
    assert problems(tmp_path, ["rollout.num_devices=2"]) == [
        "rollout.num_devices=2 is only for rollout.mode=separate"
    ]
    path = write(tmp_path, "r.yaml", MINIMAL)
    config = load_config(
        path, ["rollout.mode=separate", "rollout.num_devices=2", "rollout.tensor_model_parallel_size=2"]
    )
    assert config.rollout.num_devices == 2  # engine TP need not divide the trainer's devices
