"""Shared by the config tests: a minimal valid recipe, a writer, the problems of a failing load."""

import textwrap

import pytest

from rltrain.config import ConfigError, load_config

MINIMAL = """
model:
  tiny: {}
data:
  generated: {num_train: 64}
  train_batch_size: 8
actor:
  ppo_mini_batch_size: 4
  ppo_micro_batch_size_per_gpu: 2
critic:
  ppo_micro_batch_size_per_gpu: 2
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def errors_of(path, overrides=()):
    """The problems ``load_config(path, overrides)`` raises."""
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return info.value.problems
