"""Cross-field checks: batch arithmetic, parallel layout against devices, incompatible switches; each
problem starts with where its keys were set (the recipe's file:line, the override)."""

import pytest

from rltrain.config import ConfigError, load_config

from .recipe_helpers import MINIMAL, write


def problems(tmp_path, overrides):
    path = write(tmp_path, "r.yaml", MINIMAL)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value.problems


def line_of(text: str) -> int:
    """Line of ``text`` (its first occurrence) in the file written from MINIMAL."""
    return MINIMAL.split("\n").index(text) + 1


def at(tmp_path, text: str) -> str:
    return f"{tmp_path / 'r.yaml'}:{line_of(text)}"


def test_train_batch_must_be_multiple_of_mini_batch(tmp_path):
    mini = at(tmp_path, "  ppo_mini_batch_size: 4")
    assert problems(tmp_path, ["data.train_batch_size=10"]) == [
        f"override 'data.train_batch_size=10', {mini}: "
        "data.train_batch_size=10 is not a multiple of actor.ppo_mini_batch_size=4",
        # the critic's mini-batch is the actor's by default: nothing set it
        "override 'data.train_batch_size=10': "
        "data.train_batch_size=10 is not a multiple of critic.ppo_mini_batch_size=4",
    ]


def test_mini_batch_must_split_over_dp_and_micro_batches(tmp_path):
    # 4 prompts × n=3 = 12 samples over DP=8 ranks
    found = problems(
        tmp_path,
        ["rollout.n=3", "cluster.n_gpus_per_node=8", "critic.enable=null", "algorithm.adv_estimator=grpo"],
    )
    mini = at(tmp_path, "  ppo_mini_batch_size: 4")
    assert found == [
        f"{mini}, override 'rollout.n=3': "
        "actor.ppo_mini_batch_size × rollout.n = 4×3 = 12 samples do not split over the 8 data-parallel ranks of the actor"
    ]
    found = problems(tmp_path, ["actor.ppo_micro_batch_size_per_gpu=3"])
    assert found == [
        f"{mini}, override 'actor.ppo_micro_batch_size_per_gpu=3': "
        "4 samples per rank per mini-batch (actor.ppo_mini_batch_size × rollout.n / DP) is not a multiple of actor.ppo_micro_batch_size_per_gpu=3"
    ]


def test_parallel_layout_must_fit_devices(tmp_path):
    found = problems(tmp_path, ["cluster.n_gpus_per_node=6", "actor.parallel.tensor_model_parallel_size=4"])
    assert (
        "override 'actor.parallel.tensor_model_parallel_size=4': "
        "actor.parallel: TP×PP×CP = 4×1×1 = 4 does not divide the 6 devices given to the role"
    ) in found
    found = problems(tmp_path, ["cluster.n_gpus_per_node=4", "actor.parallel.expert_model_parallel_size=3"])
    assert any(
        "expert_model_parallel_size × expert_tensor_parallel_size = 3×1 does not divide DP×CP×TP = 4" in p
        for p in found
    )
    found = problems(
        tmp_path,
        [
            "cluster.n_gpus_per_node=2",
            "actor.parallel.tensor_model_parallel_size=2",
            "actor.parallel.expert_tensor_parallel_size=1",
        ],
    )
    assert any(
        "actor.parallel: expert_model_parallel_size × expert_tensor_parallel_size = 1×1 is below "
        "tensor_model_parallel_size=2: experts repeated over the attention tensor-parallel ranks" in p
        for p in found
    ), found
    whole_experts = [
        "cluster.n_gpus_per_node=2",
        "actor.parallel.tensor_model_parallel_size=2",
        "actor.parallel.expert_model_parallel_size=2",
        "actor.parallel.expert_tensor_parallel_size=1",
    ]
    load_config(write(tmp_path, "r.yaml", MINIMAL), whole_experts)  # whole experts on EP ranks: fine
    found = problems(tmp_path, ["rollout.tensor_model_parallel_size=2"])
    assert (
        "override 'rollout.tensor_model_parallel_size=2': "
        "rollout.tensor_model_parallel_size=2 does not divide the 1 devices (cluster.nnodes × cluster.n_gpus_per_node)"
        in found
    )


def test_incompatible_switches_are_named(tmp_path):
    assert problems(tmp_path, ["algorithm.adv_estimator=grpo"]) == [
        "override 'algorithm.adv_estimator=grpo': "
        "algorithm.adv_estimator=grpo compares samples of one prompt: needs rollout.n >= 2, got 1"
    ]
    assert problems(tmp_path, ["critic.enable=false"]) == [
        "override 'critic.enable=false': "
        "algorithm.adv_estimator=gae needs values: critic.enable=false is incompatible"
    ]
    assert problems(tmp_path, ["algorithm.kl_ctrl.type=adaptive"]) == [
        "override 'algorithm.kl_ctrl.type=adaptive': "
        "algorithm.kl_ctrl.type=adaptive has no effect without algorithm.use_kl_in_reward=true"
    ]
    assert problems(tmp_path, ["model.path=/x"]) == [
        f"override 'model.path=/x', {at(tmp_path, '  tiny: {}')}: "
        "set exactly one of model.path, model.gguf_package, model.tiny (given: model.path, model.tiny)"
    ]
    assert problems(tmp_path, ["actor.clip_ratio_c=1.0"]) == [
        "override 'actor.clip_ratio_c=1.0': actor.clip_ratio_c must be > 1 (dual-clip bound), got 1.0"
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
        "override 'actor.ppo_max_token_len_per_gpu=100', override 'data.max_prompt_length=64', "
        "override 'rollout.response_length=64': "
        "actor.ppo_max_token_len_per_gpu=100 is smaller than one sequence (data.max_prompt_length + rollout.response_length = 128)"
    ]


def test_valid_group_estimator_without_critic(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL)
    config = load_config(path, ["algorithm.adv_estimator=grpo", "rollout.n=4"])
    assert not config.critic_enabled()


def test_rollout_mode_and_transport_must_agree(tmp_path):
    assert problems(tmp_path, ["rollout.mode=separate"]) == [
        "override 'rollout.mode=separate': "
        "rollout.mode=separate needs rollout.num_devices, a multiple of rollout.tensor_model_parallel_size=1; got 0"
    ]
    assert problems(
        tmp_path,
        ["rollout.mode=separate", "rollout.num_devices=1", "rollout.weight_sync.transport=in_process"],
    ) == [
        "override 'rollout.weight_sync.transport=in_process', override 'rollout.mode=separate': "
        "rollout.weight_sync.transport=in_process cannot reach engines on other devices (rollout.mode=separate); use auto, shard_to_shard or broadcast"
    ]
    assert problems(tmp_path, ["rollout.num_devices=2"]) == [
        "override 'rollout.num_devices=2': rollout.num_devices=2 is only for rollout.mode=separate"
    ]
    path = write(tmp_path, "r.yaml", MINIMAL)
    config = load_config(
        path, ["rollout.mode=separate", "rollout.num_devices=2", "rollout.tensor_model_parallel_size=2"]
    )
    assert config.rollout.num_devices == 2  # engine TP need not divide the trainer's devices


def test_generated_task_must_fill_a_batch_and_fit_its_problem_space(tmp_path):
    assert problems(tmp_path, ["data.generated.num_train=4"]) == [
        f"override 'data.generated.num_train=4', {at(tmp_path, '  train_batch_size: 8')}: "
        "data.generated.num_train=4 is fewer prompts than one batch (data.train_batch_size=8)"
    ]
    assert problems(tmp_path, ["data.generated.max_operand=1", "data.generated.ops=['*']"]) == [
        f"{at(tmp_path, '  generated: {num_train: 64}')}, override 'data.generated.max_operand=1', "
        "override 'data.generated.ops=['*']': "
        "data.generated.num_train + data.generated.num_val = 128 exceeds the 4 distinct problems of "
        "data.generated.max_operand=1 and data.generated.ops=['*']"
    ]
    assert problems(tmp_path, ["data.generated.ops=[]"]) == [
        "override 'data.generated.ops=[]': data.generated.ops is empty: name at least one operator"
    ]


def test_data_file_of_unknown_type_names_the_list_item(tmp_path):
    assert problems(tmp_path, ["data.generated=null", "data.train_files=[a.jsonl, b.txt]"]) == [
        "override 'data.train_files=[a.jsonl, b.txt]': data.train_files[1]: 'b.txt' is not a .jsonl, "
        ".json or .parquet file"
    ]


def test_parallel_switches_name_the_size_they_need(tmp_path):
    assert problems(tmp_path, ["actor.parallel.sequence_parallel=true"]) == [
        "override 'actor.parallel.sequence_parallel=true': "
        "actor.parallel.sequence_parallel=true needs actor.parallel.tensor_model_parallel_size > 1"
    ]
    assert problems(tmp_path, ["critic.parallel.virtual_pipeline_model_parallel_size=2"]) == [
        "override 'critic.parallel.virtual_pipeline_model_parallel_size=2': "
        "critic.parallel.virtual_pipeline_model_parallel_size=2 needs "
        "critic.parallel.pipeline_model_parallel_size >= 2 (got 1)"
    ]


def test_uneven_pipeline_stages_need_a_pipeline(tmp_path):
    assert problems(tmp_path, ["actor.parallel.num_layers_in_first_pipeline_stage=2"]) == [
        "override 'actor.parallel.num_layers_in_first_pipeline_stage=2': "
        "actor.parallel.num_layers_in_first_pipeline_stage=2 needs "
        "actor.parallel.pipeline_model_parallel_size >= 2 (got 1)"
    ]
    vpp = [
        "actor.parallel.pipeline_model_parallel_size=2",
        "actor.parallel.virtual_pipeline_model_parallel_size=2",
    ]
    assert problems(tmp_path, [*vpp, "actor.parallel.num_layers_in_last_pipeline_stage=3"]) == [
        "override 'actor.parallel.num_layers_in_last_pipeline_stage=3', "
        "override 'actor.parallel.virtual_pipeline_model_parallel_size=2': "
        "actor.parallel.num_layers_in_last_pipeline_stage=3 is not a multiple of "
        "actor.parallel.virtual_pipeline_model_parallel_size=2"
    ]


def test_an_overlapping_pipeline_needs_engines_of_their_own_and_one_step_off_its_bound(tmp_path):
    assert problems(tmp_path, ["trainer.pipeline=one_step_off"]) == [
        "override 'trainer.pipeline=one_step_off': trainer.pipeline=one_step_off generates while the actor "
        "trains: it needs engines on devices of their own (rollout.mode=separate and rollout.num_devices), "
        "got rollout.mode=colocated"
    ]
    separate = ["rollout.mode=separate", "rollout.num_devices=1"]
    assert problems(tmp_path, [*separate, "trainer.pipeline=one_step_off", "trainer.max_staleness=2"]) == [
        "override 'trainer.pipeline=one_step_off', override 'trainer.max_staleness=2': "
        "trainer.pipeline=one_step_off trains on samples exactly one version old; "
        "trainer.max_staleness=2 is for trainer.pipeline=fully_async"
    ]
    path = write(tmp_path, "r.yaml", MINIMAL)
    config = load_config(path, [*separate, "trainer.pipeline=fully_async", "trainer.max_staleness=3"])
    assert (config.trainer.pipeline, config.trainer.max_staleness) == ("fully_async", 3)
    partial = [
        *separate,
        "trainer.pipeline=fully_async",
        "rollout.partial_rollout=true",
        "rollout.engine=async",
    ]
    assert load_config(path, partial).rollout.partial_rollout is True
    multi_turn = ["rollout.multi_turn.enable=true", "rollout.multi_turn.max_assistant_turns=2"]
    assert problems(tmp_path, [*partial, *multi_turn])[-1:] == [
        "override 'rollout.partial_rollout=true', override 'trainer.pipeline=fully_async', override "
        "'rollout.multi_turn.enable=true': rollout.partial_rollout=true with trainer.pipeline=fully_async "
        "records a version per sampled token of single-turn batches; rollout.multi_turn.enable=true "
        "trajectories do not carry them: set rollout.partial_rollout=false"
    ]


def test_unknown_policy_loss_mode_gets_the_registrys_line_naming_the_key(tmp_path):
    registered = (
        "cispo, clip_cov, dppo_kl, dppo_tv, dro, geo_mean, gpg, gspo, kl_cov, reinforce, sapo, vanilla"
    )
    assert problems(tmp_path, ["actor.policy_loss.loss_mode=gpso"]) == [
        "override 'actor.policy_loss.loss_mode=gpso': actor.policy_loss.loss_mode: unknown policy loss "
        f"'gpso'; registered: {registered}; did you mean 'gspo'?"
    ]
    # the plain-string spelling is the same key
    assert problems(tmp_path, ["actor.policy_loss=clip-cov"]) == [
        "actor.policy_loss.loss_mode: unknown policy loss 'clip-cov'; "
        f"registered: {registered}; did you mean 'clip_cov'?"
    ]


def test_policy_loss_section_values(tmp_path):
    assert problems(tmp_path, ["actor.policy_loss.clip_cov_lb=5"]) == [
        "override 'actor.policy_loss.clip_cov_lb=5': "
        "actor.policy_loss.clip_cov_lb=5.0 must be below actor.policy_loss.clip_cov_ub=5.0"
    ]
    assert problems(tmp_path, ["actor.policy_loss.kl_cov_ratio=0"]) == [
        "override 'actor.policy_loss.kl_cov_ratio=0': actor.policy_loss.kl_cov_ratio must be > 0, got 0.0"
    ]
    assert problems(tmp_path, ["actor.policy_loss=[gspo]"]) == [
        "override 'actor.policy_loss=[gspo]': actor.policy_loss.: expected a mapping, got ['gspo']"
    ]
    assert problems(tmp_path, ["actor.policy_loss=gspo", "actor.policy_loss.clip_cov_lb=2"]) == [
        "override 'actor.policy_loss.clip_cov_lb=2': actor.policy_loss is a value, not a section"
    ]
    assert problems(tmp_path, ["actor.loss_scale_factor=0"]) == [
        "override 'actor.loss_scale_factor=0': actor.loss_scale_factor must be >= 1, got 0"
    ]


def test_kl_estimator_names(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL)
    config = load_config(path, ["actor.kl_loss_type=k3+", "algorithm.kl_penalty=k1"])
    assert (config.actor.kl_loss_type, config.algorithm.kl_penalty) == ("k3+", "k1")
    found = problems(tmp_path, ["actor.kl_loss_type=k4+"])
    assert len(found) == 1 and found[0].startswith(
        "override 'actor.kl_loss_type=k4+': actor.kl_loss_type: 'k4+' is not one of ['kl', 'k1', 'abs'"
    )


def test_policy_loss_string_spelling_dumps_as_the_section_and_loads_back(tmp_path):
    from rltrain.config import dump_yaml

    path = write(tmp_path, "r.yaml", MINIMAL.replace("actor:\n", "actor:\n  policy_loss: geo_mean\n"))
    config = load_config(path)
    assert config.actor.policy_loss.loss_mode == "geo_mean"
    assert "  policy_loss:\n    loss_mode: geo_mean\n    clip_cov_ratio: 0.0002\n" in dump_yaml(config)
    dumped = write(tmp_path, "dumped.yaml", dump_yaml(config))
    assert load_config(dumped) == config
