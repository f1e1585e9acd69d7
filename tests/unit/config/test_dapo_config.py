"""DAPO's keys (``algorithm.filter_groups``, ``data.gen_batch_size``, ``reward.overlong_buffer``):
read from YAML with verl's names, and every combination that cannot work named in one line."""

from rltrain.config import load_config

from .recipe_helpers import MINIMAL, errors_of, write

GRPO = ["algorithm.adv_estimator=grpo", "rollout.n=4"]
DAPO = [*GRPO, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"]


def _errors(tmp_path, overrides):
    return [p.split(": ", 1)[1] for p in errors_of(write(tmp_path, "r.yaml", MINIMAL), overrides)]


def test_dapo_keys_load_with_verls_names(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL)
    config = load_config(
        path,
        [
            *DAPO,
            "algorithm.filter_groups.max_num_gen_batches=5",
            "data.gen_batch_size=24",
            "reward.overlong_buffer.enable=true",
            "reward.overlong_buffer.len=128",
            "reward.overlong_buffer.penalty_factor=0.5",
            "rollout.response_length=512",
        ],
    )
    groups, overlong = config.algorithm.filter_groups, config.reward.overlong_buffer
    assert (groups.enable, groups.metric, groups.max_num_gen_batches) == (True, "acc", 5)
    assert config.data.gen_batch_size == 24
    assert (overlong.enable, overlong.len, overlong.penalty_factor, overlong.log) == (True, 128, 0.5, True)
    # off by default
    plain = load_config(path, GRPO)
    assert not plain.algorithm.filter_groups.enable and not plain.reward.overlong_buffer.enable


def test_dynamic_sampling_combinations_that_cannot_work(tmp_path):
    assert _errors(tmp_path, [*GRPO, "algorithm.filter_groups.enable=true"]) == [
        "algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric "
        "(acc, score, seq_reward or seq_final_reward)"
    ]
    assert _errors(tmp_path, [*DAPO, "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"]) == [
        "algorithm.filter_groups.enable=true compares the samples of a prompt: needs rollout.n >= 2, got 1"
    ]
    assert _errors(tmp_path, [*DAPO, "data.gen_batch_size=4"]) == [
        "data.gen_batch_size=4 is smaller than data.train_batch_size=8"
    ]
    assert _errors(tmp_path, [*GRPO, "data.gen_batch_size=16"]) == [
        "data.gen_batch_size=16 has no effect without algorithm.filter_groups.enable=true"
    ]
    assert _errors(
        tmp_path,
        [*DAPO, "algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=true"],
    ) == [
        "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: the KL is "
        "computed after the groups are filtered; filter on seq_reward"
    ]
    async_run = [*DAPO, "trainer.pipeline=one_step_off", "rollout.mode=separate", "rollout.num_devices=1"]
    assert _errors(tmp_path, async_run) == [
        "algorithm.filter_groups.enable=true needs trainer.pipeline=sync, got one_step_off"
    ]
    assert _errors(tmp_path, [*DAPO, "reward.launch_reward_fn_async=true"]) == [
        "algorithm.filter_groups.enable=true needs each round's scores before the next round: "
        "set reward.launch_reward_fn_async=false"
    ]
    remax_async = ["algorithm.adv_estimator=remax", *async_run[3:]]
    assert _errors(tmp_path, remax_async) == [
        "algorithm.adv_estimator=remax generates its greedy baselines at the step with the trained weights: "
        "needs trainer.pipeline=sync, got one_step_off"
    ]
    assert _errors(tmp_path, [*GRPO, "algorithm.filter_groups.metric=accuracy"])[0].startswith(
        "algorithm.filter_groups.metric"
    )


def test_overlong_buffer_must_fit_the_response_budget(tmp_path):
    on = [*GRPO, "reward.overlong_buffer.enable=true", "rollout.response_length=64"]
    assert _errors(tmp_path, on) == [
        "reward.overlong_buffer.len=0 must lie in (0, rollout.response_length=64)"
    ]
    assert _errors(tmp_path, [*on, "reward.overlong_buffer.len=64"]) == [
        "reward.overlong_buffer.len=64 must lie in (0, rollout.response_length=64)"
    ]
    assert _errors(
        tmp_path, [*on, "reward.overlong_buffer.len=16", "reward.overlong_buffer.penalty_factor=-1"]
    ) == ["reward.overlong_buffer.penalty_factor must be >= 0, got -1.0"]


def test_greedy_sampling_takes_one_sample(tmp_path):
    assert _errors(tmp_path, [*GRPO, "rollout.temperature=0"]) == [
        "rollout.temperature=0 is greedy: its samples are all alike and vLLM refuses rollout.n=4 > 1 with it"
    ]
    assert _errors(tmp_path, ["rollout.val_kwargs.n=2"]) == [
        "rollout.val_kwargs.temperature=0 is greedy: its samples are all alike and vLLM refuses "
        "rollout.val_kwargs.n=2 > 1 with it"
    ]
