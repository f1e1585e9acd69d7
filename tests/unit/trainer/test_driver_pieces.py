"""Driver helpers: schedule, reward placement, mini-batch plan."""

import torch

from rltrain.trainer.algorithms.base import score_at_last_token
from rltrain.trainer.driver import _due, _mean_over_steps


def test_due_schedule():
    assert [s for s in range(1, 8) if _due(3, s, s == 7)] == [3, 6, 7]
    assert [s for s in range(1, 8) if _due(-1, s, s == 7)] == [7]
    assert [s for s in range(1, 8) if _due(0, s, s == 7)] == []


def test_score_sits_on_the_last_valid_token():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    rewards = score_at_last_token(torch.tensor([2.0, -1.0, 0.5]), mask)
    assert rewards.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, -1.0], [0.5, 0.0, 0.0]]


def test_metrics_average_over_optimizer_steps_and_skips_add_up():
    steps = [
        {"actor/pg_loss": 1.0, "actor/skipped_steps": 0.0},
        {"actor/pg_loss": 3.0, "actor/skipped_steps": 1.0},
    ]
    assert _mean_over_steps(steps) == {"actor/pg_loss": 2.0, "actor/skipped_steps": 1.0}


def test_mini_batches_cover_each_sample_once_per_epoch(tmp_path):
    from rltrain.config import load_config
    from rltrain.data.step_batch import build_step_batch
    from rltrain.trainer.driver import PPOTrainer, Roles

    config = load_config(
        "recipes/quickstart_cpu.yaml",
        [
            f"trainer.default_local_dir={tmp_path}",
            "actor.ppo_epochs=2",
            "data.train_batch_size=16",
            "rollout.n=2",
            "actor.ppo_mini_batch_size=4",
            "actor.ppo_micro_batch_size_per_gpu=8",
            "critic.ppo_micro_batch_size_per_gpu=8",
        ],
    )
    trainer = PPOTrainer(
        config, roles=Roles(None, None), tokenizer=None, data=None, rewards=None, tracker=None, total_steps=1
    )
    n = config.rollout.n
    batch = build_step_batch(
        prompt_ids=[[p] for p in range(16)],
        response_ids=[[s] for s in range(16 * n)],
        response_logprobs=[[0.0]] * (16 * n),
        finish_reasons=["stop"] * (16 * n),
        n=n,
        data_sources=["arithmetic"] * 16,
        ground_truths=["0"] * 16,
        pad_token_id=0,
        response_length=2,
    )
    minis = trainer.mini_batches(batch, step=3)
    assert len(minis) == 2 * 4 and all(m.batch_size == 4 * n for m in minis)
    for epoch in (minis[:4], minis[4:]):
        seen = sorted(int(x) for m in epoch for x in m.response_ids[:, 0])
        assert seen == list(range(16 * n))
    order = [int(x) for m in minis for x in m.response_ids[:, 0]]
    assert order[: 16 * n] != order[16 * n :], "epochs are reshuffled"
    again = [int(x) for m in trainer.mini_batches(batch, step=3) for x in m.response_ids[:, 0]]
    assert again == order, "the plan is a function of (seed, step)"


def test_score_sits_on_the_last_sampled_token_across_tool_gaps():
    # model | tool tool | model, then padding; a model turn followed only by tool tokens; an empty row
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0], [0.0] * 5])
    rewards = score_at_last_token(torch.tensor([2.0, -1.0, 0.5]), mask)
    assert rewards.tolist() == [[0, 0, 0, 2.0, 0], [0, -1.0, 0, 0, 0], [0.5, 0, 0, 0, 0]]
