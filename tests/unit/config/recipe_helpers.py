"""Shared by the config tests: a minimal valid recipe and a writer."""

import textwrap

MINIMAL = """
model:
  tiny: {}
data:
  generated: {}
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
