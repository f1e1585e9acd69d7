"""Strict keys with suggestions and file:line, base inheritance, overrides and coercion."""

import dataclasses

import pytest

from rltrain.config import ConfigError, RolloutConfig, load_config

from .recipe_helpers import MINIMAL, errors_of, write

ROLLOUT_KEYS = [f.name for f in dataclasses.fields(RolloutConfig)]


def test_minimal_recipe_gets_documented_defaults(tmp_path):
    config = load_config(write(tmp_path, "r.yaml", MINIMAL))
    assert config.actor.clip_ratio == 0.2 and config.actor.clip_ratio_c == 3.0
    assert config.algorithm.adv_estimator == "gae" and config.critic_enabled()
    assert config.critic.optim.lr == 1e-5 and config.actor.optim.lr == 1e-6
    assert config.model.tiny.model_type == "llama"


def test_misspelled_key_names_path_line_and_suggestion(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL + "  ppo_mini_batchsize: 4\n")
    (problem,) = errors_of(path)
    line = MINIMAL.count("\n") + 1
    assert problem == (
        f"{path}:{line}: unknown key 'critic.ppo_mini_batchsize'; did you mean 'critic.ppo_mini_batch_size'?"
    )


def test_key_in_wrong_section_points_to_the_right_one(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL + "rollout:\n  kl_loss_coef: 0.1\n")
    (problem,) = errors_of(path)
    assert "unknown key 'rollout.kl_loss_coef'" in problem
    assert "did you mean 'actor.kl_loss_coef'?" in problem


def test_every_problem_is_reported_at_once(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL + "trainer:\n  save_frq: 1\n  seed: abc\n")
    problems = errors_of(path)
    assert len(problems) == 2
    assert any("trainer.save_frq" in p and "trainer.save_freq" in p for p in problems)
    assert any("trainer.seed: expected int, got 'abc'" in p for p in problems)


def test_overrides_coerce_and_win(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL)
    config = load_config(
        path,
        [
            "actor.optim.lr=1e-6",
            "rollout.n=4",
            "actor.use_kl_loss=true",
            "rollout.stop=['x', 'y']",
            "model.tiny.seed=7",
            "actor.optim.betas=[0.9, 0.95]",
        ],
    )
    assert config.actor.optim.lr == 1e-6 and isinstance(config.actor.optim.lr, float)
    assert config.rollout.n == 4 and config.actor.use_kl_loss is True
    assert config.rollout.stop == ["x", "y"] and config.model.tiny.seed == 7
    assert config.actor.optim.betas == (0.9, 0.95)


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    # YAML 1.1 reads `1e-6` as a string; the loader coerces it for float fields.
    path = write(tmp_path, "r.yaml", MINIMAL.replace("actor:\n", "actor:\n  optim: {lr: 1e-6}\n"))
    assert load_config(path).actor.optim.lr == 1e-6


def test_bad_override_values_are_named(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL)
    problems = errors_of(path, ["actor.use_kl_loss=maybe", "algorithm.kl_penalty=low_var_k", "rollout.n=2.5"])
    assert (
        "override 'actor.use_kl_loss=maybe': actor.use_kl_loss: expected true or false, got 'maybe'"
        in problems
    )
    assert any(
        "algorithm.kl_penalty: 'low_var_k' is not one of" in p and "did you mean 'low_var_kl'" in p
        for p in problems
    )
    assert any("rollout.n: expected an integer, got 2.5" in p for p in problems)
    assert "KEY=VALUE" in errors_of(path, ["actor.optim.lr"])[0]


def test_base_inheritance_merges_and_replaces_lists(tmp_path):
    write(tmp_path, "parent.yaml", MINIMAL + "rollout:\n  stop: [a, b]\n  n: 3\n")
    child = write(tmp_path, "child.yaml", "base: parent.yaml\nrollout:\n  stop: [c]\n")
    config = load_config(child)
    assert config.rollout.stop == ["c"] and config.rollout.n == 3
    assert config.data.train_batch_size == 8


def test_errors_point_into_the_file_that_set_the_key(tmp_path):
    parent = write(tmp_path, "parent.yaml", MINIMAL + "rollout:\n  n: two\n")
    child = write(tmp_path, "child.yaml", "base: parent.yaml\nrollout:\n  bogus: 1\n")
    assert errors_of(child) == [
        f"{parent}:{MINIMAL.count(chr(10)) + 2}: rollout.n: expected int, got 'two'",
        f"{child}:3: unknown key 'rollout.bogus'; valid keys here: " + ", ".join(sorted(ROLLOUT_KEYS)),
    ]


def test_circular_and_missing_base(tmp_path):
    write(tmp_path, "a.yaml", "base: b.yaml\n")
    write(tmp_path, "b.yaml", "base: a.yaml\n")
    assert "circular base" in errors_of(tmp_path / "a.yaml")[0]
    missing = write(tmp_path, "c.yaml", "base: nope.yaml\n")
    assert "recipe file not found" in errors_of(missing)[0] and "nope.yaml" in errors_of(missing)[0]


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "r.yaml", "model:\n  tiny: {\n")
    (problem,) = errors_of(path)
    assert problem.startswith(f"{path}:") and "not valid YAML" in problem


def test_unknown_section_from_an_override_is_blamed_on_the_override(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL)
    assert errors_of(path, ["trainr.seed=1"]) == [
        "override 'trainr.seed=1': unknown key 'trainr'; did you mean 'trainer'?"
    ]


def test_bad_list_item_names_the_item_line_or_the_override(tmp_path):
    line = MINIMAL.count("\n") + 1
    choices = "['console', 'tensorboard', 'jsonl', 'wandb']; did you mean 'tensorboard'?"
    path = write(tmp_path, "r.yaml", MINIMAL + "trainer:\n  logger:\n    - console\n    - tensorbord\n")
    assert errors_of(path) == [f"{path}:{line + 3}: trainer.logger[1]: 'tensorbord' is not one of {choices}"]
    path = write(tmp_path, "r.yaml", MINIMAL + "trainer:\n  logger: [console]\n")
    assert errors_of(path, ["trainer.logger=[console, tensorbord]"]) == [
        f"override 'trainer.logger=[console, tensorbord]': trainer.logger[1]: 'tensorbord' is not one of {choices}"
    ]


def test_single_problem_prints_on_one_line(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL)
    with pytest.raises(ConfigError) as info:
        load_config(path, ["actor.optim.lr=nan"])
    assert str(info.value) == (
        "invalid configuration: override 'actor.optim.lr=nan': actor.optim.lr must be a finite number, got nan"
    )


def test_recipe_with_a_non_utf8_byte_names_its_line(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_bytes(MINIMAL.encode() + b"trainer:\n  experiment_name: caf\xe9\n")
    assert errors_of(path) == [f"{path}:{MINIMAL.count(chr(10)) + 2}: not UTF-8 text (byte 0xe9)"]
