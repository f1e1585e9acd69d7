"""The reward model reads the policy's token ids: a reward-model directory whose tokenizer maps
tokens differently, or that has none, is refused before any worker starts, naming the directory."""

import pytest

from rltrain.config import load_config
from rltrain.errors import RunStopped
from rltrain.models.tiny import build_tiny_tokenizer
from rltrain.trainer.run import check_reward_model_tokenizer


def _config(path):
    return load_config(
        "recipes/quickstart_cpu.yaml",
        ["reward.reward_model.enable=true", f"reward.reward_model.model.path={path}"],
    )


def test_the_same_tokenizer_passes_and_another_or_none_is_refused(tmp_path):
    policy = build_tiny_tokenizer(vocab_size=300)
    same, other, empty = tmp_path / "same", tmp_path / "other", tmp_path / "empty"
    policy.save_pretrained(same)
    build_tiny_tokenizer(vocab_size=280).save_pretrained(other)
    empty.mkdir()
    check_reward_model_tokenizer(_config(same), policy)  # no error
    with pytest.raises(RunStopped) as info:
        check_reward_model_tokenizer(_config(other), policy)
    assert str(info.value) == (
        f"reward.reward_model.model.path={other}: its tokenizer (280 tokens) differs from the policy's "
        f"({len(policy)} tokens); the reward model reads the policy's token ids"
    )
    with pytest.raises(
        RunStopped, match=rf"^reward.reward_model.model.path={empty}: no tokenizer could be loaded"
    ):
        check_reward_model_tokenizer(_config(empty), policy)
    # without a reward model nothing is read
    check_reward_model_tokenizer(load_config("recipes/quickstart_cpu.yaml"), policy)
