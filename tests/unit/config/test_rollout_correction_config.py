"""``algorithm.rollout_correction`` (verl's keys): defaults, one-line errors naming the key, and how
``actor.tis_imp_ratio_cap`` may sit beside it."""

import pytest

from rltrain.config import ConfigError, load_config

from .recipe_helpers import MINIMAL, write


def load(tmp_path, overrides):
    return load_config(write(tmp_path, "r.yaml", MINIMAL), overrides)


def problems(tmp_path, overrides) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, overrides)
    return info.value.problems


def test_off_by_default_and_verl_defaults_inside_the_section(tmp_path):
    assert load(tmp_path, []).algorithm.rollout_correction is None
    section = load(
        tmp_path, ["algorithm.rollout_correction.rollout_is=sequence"]
    ).algorithm.rollout_correction
    assert (
        section.rollout_is,
        section.rollout_is_threshold,
        section.rollout_rs,
        section.rollout_rs_threshold,
    ) == (
        "sequence",
        2.0,
        None,
        None,
    )
    rs = load(
        tmp_path,
        [
            "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.9_1.1",
        ],
    ).algorithm.rollout_correction
    assert rs.spec().rejection[0].lower == 0.9


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.rollout_correction.rollout_rs=seq_mean_k1"],
            "algorithm.rollout_correction.rollout_rs='seq_mean_k1' needs rollout_rs_threshold",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_rs=token_k1",
                "algorithm.rollout_correction.rollout_rs_threshold=2.0_1.0",
            ],
            "algorithm.rollout_correction.rollout_rs_threshold of token_k1 needs lower < upper, got '2.0_1.0'",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_rs=token_k9",
                "algorithm.rollout_correction.rollout_rs_threshold=2",
            ],
            "algorithm.rollout_correction.rollout_rs option 'token_k9' is not one of",
        ),
        (
            ["algorithm.rollout_correction.rollout_is_threshold=0"],
            "algorithm.rollout_correction.rollout_is_threshold must be > 0",
        ),
        (
            ["algorithm.rollout_correction.rollout_is_threshold=.inf"],
            "algorithm.rollout_correction.rollout_is_threshold",
        ),
        (
            ["actor.tis_imp_ratio_cap=2.0", "algorithm.rollout_correction.rollout_is=sequence"],
            "actor.tis_imp_ratio_cap=2.0 disagrees with algorithm.rollout_correction.rollout_is=sequence",
        ),
        (
            ["actor.tis_imp_ratio_cap=3.0", "algorithm.rollout_correction.rollout_is=token"],
            "actor.tis_imp_ratio_cap=3.0 disagrees with algorithm.rollout_correction.rollout_is=token, "
            "rollout_is_threshold=2.0",
        ),
    ],
)
def test_a_bad_value_is_one_line_naming_its_key(tmp_path, overrides, message):
    found = problems(tmp_path, overrides)
    assert len(found) == 1 and "\n" not in found[0], found
    assert message in found[0], found


def test_the_older_tis_key_may_agree_with_the_section(tmp_path):
    config = load(
        tmp_path,
        [
            "actor.tis_imp_ratio_cap=3.0",
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=3.0",
        ],
    )
    assert config.actor.tis_imp_ratio_cap == 3.0
