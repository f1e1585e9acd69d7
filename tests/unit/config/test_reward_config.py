"""``reward.custom_reward_function`` (verl's keys), ``reward.remote``, ``reward.sandbox`` and the format
bonus keys: defaults, values through the strict loader, and one-line problems naming the keys."""

import pytest

from rltrain.config import load_config

from .recipe_helpers import MINIMAL, errors_of, write


def load(tmp_path, overrides):
    return load_config(write(tmp_path, "r.yaml", MINIMAL), overrides).reward


def test_defaults_leave_the_rule_rewards_alone(tmp_path):
    reward = load(tmp_path, [])
    custom, remote, sandbox = reward.custom_reward_function, reward.remote, reward.sandbox
    assert (custom.path, custom.name, custom.reward_kwargs) == (None, "compute_score", {})  # verl's name
    assert (remote.enable, remote.url, remote.timeout_s, remote.max_retries) == (False, None, 30.0, 3)
    assert (remote.backoff_s, remote.max_concurrency) == (1.0, 16)
    assert (sandbox.timeout_s, sandbox.memory_mb) == (10.0, 512)
    assert (reward.format_pattern, reward.format_coef) == (None, 0.0)


def test_values_arrive_typed(tmp_path):
    reward = load(
        tmp_path,
        [
            "reward.custom_reward_function.path=rewards/mine.py",
            "reward.custom_reward_function.name=judge",
            "reward.custom_reward_function.reward_kwargs={method: flexible, weight: 2}",
            "reward.sandbox.timeout_s=2.5",
            "reward.sandbox.memory_mb=256",
            "reward.format_pattern=<think>.*</think>.*",
            "reward.format_coef=0.1",
        ],
    )
    assert reward.custom_reward_function.path == "rewards/mine.py"
    assert reward.custom_reward_function.name == "judge"
    assert reward.custom_reward_function.reward_kwargs == {"method": "flexible", "weight": 2}
    assert (reward.sandbox.timeout_s, reward.sandbox.memory_mb) == (2.5, 256)
    assert (reward.format_pattern, reward.format_coef) == ("<think>.*</think>.*", 0.1)
    remote = load(
        tmp_path,
        [
            "reward.remote.enable=true",
            "reward.remote.url=https://judge.example:8443/score",
            "reward.remote.timeout_s=5",
            "reward.remote.max_retries=0",
            "reward.remote.backoff_s=0",
            "reward.remote.max_concurrency=64",
        ],
    ).remote
    assert (remote.url, remote.timeout_s, remote.max_retries, remote.backoff_s, remote.max_concurrency) == (
        "https://judge.example:8443/score",
        5.0,
        0,
        0.0,
        64,
    )


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (
            ["reward.format_pattern=<answer>(.*"],
            "reward.format_pattern='<answer>(.*' is not a valid regular expression: missing ), "
            "unterminated subpattern at position 8",
        ),
        (["reward.format_coef=0.5"], "reward.format_coef=0.5 needs reward.format_pattern"),
        (["reward.format_pattern=''"], "reward.format_pattern is empty; null for no format bonus"),
        (["reward.remote.enable=true"], "reward.remote.enable needs reward.remote.url"),
        (
            ["reward.remote.enable=true", "reward.remote.url=judge:80"],
            "reward.remote.url='judge:80' is not an http:// or https:// address",
        ),
        (
            ["reward.custom_reward_function.path=r.py", "reward.custom_reward_function.name=my-score"],
            "reward.custom_reward_function.name='my-score' is not a Python function name",
        ),
        (
            [
                "reward.custom_reward_function.path=r.py",
                "reward.remote.enable=true",
                "reward.remote.url=http://j",
            ],
            "reward.custom_reward_function.path and reward.remote.enable are both set; each scores every "
            "row: keep one",
        ),
        (["reward.sandbox.memory_mb=63"], "reward.sandbox.memory_mb must be >= 64, got 63"),
        (["reward.remote.max_concurrency=0"], "reward.remote.max_concurrency must be >= 1, got 0"),
        (
            ["reward.remote.urll=http://j"],
            "unknown key 'reward.remote.urll'; did you mean 'reward.remote.url'?",
        ),
        (
            ["reward.custom_reward_function.file=r.py"],
            "unknown key 'reward.custom_reward_function.file'; valid keys here: name, path, reward_kwargs",
        ),
    ],
)
def test_bad_values_name_their_keys_in_one_line(tmp_path, overrides, problem):
    [got] = errors_of(write(tmp_path, "r.yaml", MINIMAL), overrides)
    assert got.split(": ", 1)[1] == problem


def test_a_disabled_remote_section_is_not_checked(tmp_path):
    assert load(tmp_path, ["reward.remote.url=not a url"]).remote.enable is False
