"""Bad numbers and where they came from: NaN/inf anywhere, sizes below their bound, duplicate keys,
origins of range and cross-field problems (file:line or the override), values whose docstring gives
0 or -1 a meaning still valid."""

import dataclasses
import types
import typing

import pytest

from rltrain.config import RLConfig, load_config
from rltrain.config.fields import AtLeast, field_problems

from .recipe_helpers import MINIMAL, errors_of, write

APPENDED = MINIMAL.count("\n") + 1
"""Line of the first line appended to MINIMAL in a file written from it."""


def leaf_fields(cls: type, prefix: str = "") -> list[tuple[str, typing.Any]]:
    """(dotted key, type hint with extras) of every non-dataclass field under ``cls``."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        inner = next(
            (
                a
                # not into dict[str, Section]: its keys are the user's (cluster.resource_pools.<name>)
                for a in (hint, *(() if typing.get_origin(hint) is dict else typing.get_args(hint)))
                if isinstance(a, type) and dataclasses.is_dataclass(a)
            ),
            None,
        )
        out += leaf_fields(inner, f"{prefix}{f.name}.") if inner else [(f"{prefix}{f.name}", hint)]
    return out


def core(hint) -> tuple[typing.Any, AtLeast | None]:
    """The type under Optional and Annotated, and the bound Annotated carries."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    if typing.get_origin(hint) is typing.Annotated:
        return typing.get_args(hint)[0], hint.__metadata__[0]
    return hint, None


FIELDS = {key: core(hint) for key, hint in leaf_fields(RLConfig)}
BOUNDED = sorted(key for key, (_, bound) in FIELDS.items() if bound is not None)
FLOATS = sorted(key for key, (base, _) in FIELDS.items() if base is float)


def test_the_walk_finds_the_bounded_and_float_fields():
    assert FIELDS["actor.ppo_mini_batch_size"] == (int, AtLeast(1))
    assert FIELDS["actor.parallel.tensor_model_parallel_size"] == (int, AtLeast(1))
    assert FIELDS["rollout.num_devices"] == (int, AtLeast(0))
    assert FIELDS["actor.optim.lr"] == (float, AtLeast(0, exclusive=True))
    assert FIELDS["rollout.top_k"] == FIELDS["trainer.save_freq"] == (int, None)  # -1 means something
    assert {"actor.optim.lr", "actor.clip_ratio_low", "rollout.temperature", "reward.correct_score"} <= set(
        FLOATS
    )


@pytest.mark.parametrize("key", BOUNDED)
def test_every_bounded_field_refuses_the_value_below_it(tmp_path, key):
    base, bound = FIELDS[key]
    path = write(tmp_path, "r.yaml", MINIMAL)
    bad = int(bound.bound) - (0 if bound.exclusive else 1)
    sign = ">" if bound.exclusive else ">="
    assert errors_of(path, [f"{key}={bad}"]) == [
        f"override '{key}={bad}': {key} must be {sign} {int(bound.bound)}, got {base(bad)}"
    ]


@pytest.mark.parametrize("key", FLOATS)
@pytest.mark.parametrize("text", [".nan", ".inf", "-.inf"])
def test_every_float_field_refuses_nan_and_inf(tmp_path, key, text):
    path = write(tmp_path, "r.yaml", MINIMAL)
    value = float(text.replace(".", ""))
    assert errors_of(path, [f"{key}={text}"]) == [
        f"override '{key}={text}': {key} must be a finite number, got {value}"
    ]


def test_nan_written_in_a_recipe_names_file_and_line(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL + "  optim:\n    lr: nan\n")
    assert errors_of(path) == [f"{path}:{APPENDED + 1}: critic.optim.lr must be a finite number, got nan"]


def test_nan_inside_a_list_and_a_mapping_is_found(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL)
    assert errors_of(path, ["actor.optim.betas=[0.9, .inf]"]) == [
        "override 'actor.optim.betas=[0.9, .inf]': actor.optim.betas[1] must be a finite number, got inf"
    ]
    assert errors_of(path, ["model.override_config={rope_theta: .nan}"]) == [
        "override 'model.override_config={rope_theta: .nan}': model.override_config.rope_theta must be a "
        "finite number, got nan"
    ]


def test_integer_fields_refuse_nan_and_inf_as_not_integers(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL)
    assert errors_of(path, ["trainer.seed=.inf", "rollout.n=nan"]) == [
        "override 'trainer.seed=.inf': trainer.seed: expected an integer, got inf",
        "override 'rollout.n=nan': rollout.n: expected an integer, got 'nan'",
    ]


def test_values_whose_docstring_gives_zero_or_minus_one_a_meaning_stay_valid(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL)
    config = load_config(
        path,
        [
            "rollout.top_k=-1",
            "trainer.save_freq=0",
            "trainer.test_freq=-1",
            "reward.num_workers=0",
            "actor.optim.clip_grad=0",
            "actor.optim.lr_warmup_steps=0",
            "critic.warmup_steps=0",
            "actor.entropy_coeff=0",
            "rollout.temperature=0",
            "data.generated.num_val=0",
        ],
    )
    assert (config.rollout.top_k, config.trainer.save_freq, config.actor.optim.clip_grad) == (-1, 0, 0.0)
    assert errors_of(path, ["rollout.top_k=0"]) == [
        "override 'rollout.top_k=0': rollout.top_k must be >= 1, or -1 to disable, got 0"
    ]


def test_zero_sizes_in_a_recipe_name_file_line_and_key(tmp_path):
    path = write(tmp_path, "r.yaml", MINIMAL.replace("ppo_mini_batch_size: 4", "ppo_mini_batch_size: 0"))
    line = MINIMAL.split("\n").index("  ppo_mini_batch_size: 4") + 1
    assert errors_of(path) == [f"{path}:{line}: actor.ppo_mini_batch_size must be >= 1, got 0"]
    path = write(tmp_path, "r.yaml", MINIMAL + "cluster:\n  n_gpus_per_node: 0\n")
    assert errors_of(path) == [f"{path}:{APPENDED + 1}: cluster.n_gpus_per_node must be >= 1, got 0"]


def test_field_problems_walks_a_config_built_in_code():
    config = RLConfig()
    config.actor.parallel.tensor_model_parallel_size = 0
    config.actor.optim.betas = (float("nan"), 0.999)
    assert field_problems(config) == [
        "actor.optim.betas[0] must be a finite number, got nan",
        "actor.parallel.tensor_model_parallel_size must be >= 1, got 0",
    ]
    assert config.actor.parallel.validate("actor.parallel", 4) == [
        "actor.parallel.tensor_model_parallel_size must be >= 1, got 0"
    ]


def test_duplicate_keys_name_both_lines(tmp_path):
    path = write(
        tmp_path, "r.yaml", MINIMAL + "  ppo_micro_batch_size_per_gpu: 4\nrollout:\n  n: 2\n  n: 3\n"
    )
    assert errors_of(path) == [
        f"{path}:{APPENDED}: duplicate key 'critic.ppo_micro_batch_size_per_gpu' (first at line "
        f"{APPENDED - 1}); YAML would keep only the last",
        f"{path}:{APPENDED + 3}: duplicate key 'rollout.n' (first at line {APPENDED + 2}); "
        "YAML would keep only the last",
    ]
    path = write(tmp_path, "s.yaml", "data: {}\n" + MINIMAL)
    line = 1 + MINIMAL.split("\n").index("data:") + 1
    assert errors_of(path) == [
        f"{path}:{line}: duplicate key 'data' (first at line 1); YAML would keep only the last"
    ]
