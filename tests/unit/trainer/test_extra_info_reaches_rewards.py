"""A row's ``extra_info`` reaches a custom reward function (verl's ``extra_info`` keyword) through the
real driver, for training samples (each sample gets its prompt's) and for validation: the custom
function scores with a number only the row's ``extra_info`` holds."""

from dataclasses import replace

from tests.unit.trainer import test_sample_tracing as fake

CUSTOM = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(extra_info["weight"]) if solution_str == ground_truth else -1.0
"""


def test_extra_info_reaches_a_custom_reward_in_training_and_validation(tmp_path, monkeypatch):
    from rltrain.rewards import RewardManager

    path = tmp_path / "weighted.py"
    path.write_text(CUSTOM)
    weighted = [replace(ex, extra_info={"weight": 10 + ex.index}) for ex in fake.TRAIN]
    val = [replace(ex, extra_info={"weight": 100 + ex.index}) for ex in fake.VAL]
    trainer = fake.trainer_for(tmp_path, f"reward.custom_reward_function.path={path}", total_steps=1)
    trainer.rewards = RewardManager.from_config(trainer.config.reward)
    trainer.data = fake.Data(train=fake.Loader(weighted), val=val)
    trainer.fit()
    rows = fake.read_rows(tmp_path / "rollouts" / "1.jsonl")
    want = []
    for ex in weighted[:4]:
        a, b = map(int, ex.prompt.rstrip("=").split("+"))
        want += [10.0 + ex.index if text == ex.ground_truth else -1.0 for text, _ in fake.answers(a, b)]
    assert [r["score"] for r in rows] == want
    assert -1.0 in want and len(set(want)) > 2  # both branches, and weights differ by prompt
    val_rows = fake.read_rows(tmp_path / "val" / "0.jsonl")
    # greedy validation (val_kwargs.n = 1) answers right: each prompt's own weight
    assert [r["score"] for r in val_rows] == [100.0 + ex.index for ex in fake.VAL]
