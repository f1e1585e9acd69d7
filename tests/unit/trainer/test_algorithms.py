"""Algorithms as objects: which one a config builds and what it needs, ReMax's extra rollout through a
scripted stand-in for the trainer's rollouts, the critic warm-up, and a new algorithm added as one
registered class that the trainer then uses (values by hand)."""

import pytest
import torch

from rltrain.config import load_config
from rltrain.data.loader import PromptBatch
from rltrain.data.step_batch import build_step_batch
from rltrain.rollout.types import SamplingConfig
from rltrain.trainer import algorithms
from rltrain.trainer.algorithms import Algorithm, Needs, build_algorithm, register_algorithm
from rltrain.trainer.algorithms.remax import ReMax
from rltrain.trainer.driver import PPOTrainer, Roles
from rltrain.trainer.dynamic_sampling import ScoredRound


def config_of(tmp_path, *overrides: str):
    return load_config(
        "recipes/quickstart_cpu.yaml",
        [f"trainer.default_local_dir={tmp_path}", "actor.ppo_micro_batch_size_per_gpu=8", *overrides],
    )


def batch_of(scores: list[float], *, n: int, lengths: list[int]):
    batch = build_step_batch(
        prompt_ids=[[1]] * (len(scores) // n),
        response_ids=[[5] * k for k in lengths],
        response_logprobs=[[0.0] * k for k in lengths],
        finish_reasons=["stop"] * len(scores),
        n=n,
        data_sources=["arithmetic"] * (len(scores) // n),
        ground_truths=["0"] * (len(scores) // n),
        pad_token_id=0,
        response_length=max(lengths),
    )
    batch.scores = torch.tensor(scores)
    return batch


def test_each_config_builds_its_algorithm_and_needs(tmp_path):
    quickstart = build_algorithm(config_of(tmp_path))  # GAE, KL in the reward
    assert type(quickstart) is Algorithm
    assert quickstart.needs == Needs(critic=True, reference=True, reward_model=False)
    grpo = build_algorithm(
        config_of(tmp_path, "algorithm.adv_estimator=grpo", "rollout.n=2", "algorithm.use_kl_in_reward=false")
    )
    assert type(grpo) is Algorithm and grpo.needs == Needs(critic=False, reference=False, reward_model=False)
    remax = build_algorithm(config_of(tmp_path, "algorithm.adv_estimator=remax", "actor.use_kl_loss=true"))
    assert type(remax) is ReMax and remax.needs == Needs(critic=False, reference=True, reward_model=False)


class ScriptedRolloutsDouble:
    """Stands in for the trainer's rollouts: records what it is asked, answers scored rounds."""

    def __init__(self, greedy_scores: list[float]) -> None:
        self.greedy_scores, self.asked = greedy_scores, []

    def sampling(self, step: int) -> SamplingConfig:
        return SamplingConfig(temperature=1.0, top_p=0.9, top_k=5, n=2, seed=100 + step, response_length=4)

    def generate_and_score(self, prompts, sampling, *, uid_prefix):
        self.asked.append((sampling, uid_prefix))
        batch = batch_of(self.greedy_scores, n=1, lengths=[2] * len(self.greedy_scores))
        return ScoredRound(prompts, batch, None)

    def next_prompts(self):
        raise AssertionError("ReMax draws no further prompts")

    @property
    def pad_token_id(self) -> int:
        return 0


def test_remax_adds_the_greedy_rollout_and_its_baselines(tmp_path):
    algo = build_algorithm(config_of(tmp_path, "algorithm.adv_estimator=remax", "rollout.n=2"))
    first = ScoredRound(
        PromptBatch([None, None], epoch=0, position=0),
        batch_of([1.0, 0.0, 0.5, 2.0], n=2, lengths=[1, 2, 3, 1]),
        None,
    )
    rollouts = ScriptedRolloutsDouble(greedy_scores=[0.25, 1.5])
    scored, metrics = algo.extra_rollouts(rollouts, 3, first)
    assert metrics == {} and scored is first
    ((sampling, prefix),) = rollouts.asked
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.n, sampling.seed) == (
        0.0,
        1.0,
        -1,
        1,
        103,
    )
    assert prefix == "step3-greedy"
    assert scored.batch.reward_baselines.tolist() == [0.25, 0.25, 1.5, 1.5]


def test_the_critic_warm_up_holds_the_actor_back(tmp_path):
    algo = build_algorithm(config_of(tmp_path, "critic.warmup_steps=2"))
    assert [algo.updates_actor(step) for step in (1, 2, 3)] == [False, False, True]
    no_critic = build_algorithm(
        config_of(tmp_path, "algorithm.adv_estimator=grpo", "rollout.n=2", "critic.warmup_steps=2")
    )
    assert [no_critic.updates_actor(step) for step in (1, 2, 3)] == [True, True, True]


def test_a_new_algorithm_is_one_registered_class(tmp_path, monkeypatch):
    """A class registered for an estimator is what the trainer runs: here one that adds a length bonus
    of 0.1 per response token to the score before the estimator (GRPO: (r - mean) / std per group)."""
    monkeypatch.setattr(algorithms.base, "ALGORITHMS", dict(algorithms.base.ALGORITHMS))

    @register_algorithm("grpo")
    class LengthBonus(Algorithm):
        def shape_rewards(self, batch):
            batch.scores = batch.scores + 0.1 * batch.response_mask.sum(-1)
            return super().shape_rewards(batch)

    config = config_of(
        tmp_path, "algorithm.adv_estimator=grpo", "rollout.n=2", "algorithm.use_kl_in_reward=false"
    )
    trainer = PPOTrainer(
        config, roles=Roles(None, None), tokenizer=None, data=None, rewards=None, tracker=None, total_steps=1
    )
    assert type(trainer.algorithm) is LengthBonus
    batch = batch_of([1.0, 0.0, 0.5, 0.5], n=2, lengths=[1, 3, 2, 4])
    trainer.algorithm.advantages(batch)
    # shaped: 1.1, 0.3 | 0.7, 0.9 → each group ±(half the gap) / its std (gap / √2), unbiased: ±1/√2
    expected = [1 / 2**0.5, -1 / 2**0.5, -1 / 2**0.5, 1 / 2**0.5]
    valid = batch.response_mask.bool()
    for row, value in enumerate(expected):
        assert batch.advantages[row][valid[row]].tolist() == pytest.approx(
            [value] * int(valid[row].sum()), abs=1e-5
        )
    with pytest.raises(ValueError, match="already registered for adv_estimator 'grpo'"):
        register_algorithm("grpo")(Algorithm)


def test_the_algorithm_owns_the_losses_the_updates_get(tmp_path, monkeypatch):
    """The actor's and critic's losses are the algorithm's, built from ``actor.*`` / ``critic.*`` by
    default, and what the trainer hands the policy's update is the algorithm's object."""
    config = config_of(
        tmp_path,
        "actor.use_kl_loss=true",
        "actor.kl_loss_coef=0.05",
        "actor.kl_loss_type=low_var_kl",
        "actor.entropy_coeff=0.01",
        "actor.clip_ratio_high=0.28",
        "actor.tis_imp_ratio_cap=2.0",
        "critic.cliprange_value=0.3",
    )
    algo = build_algorithm(config)
    actor = algo.actor_loss
    assert (actor.loss_mode, actor.loss_agg_mode, actor.entropy_coeff) == ("vanilla", "token-mean", 0.01)
    assert (actor.kl_loss.coef, actor.kl_loss.kind) == (0.05, "low_var_kl")
    assert (actor.params.clip_ratio, actor.params.clip_ratio_high) == (0.2, 0.28)
    assert (actor.correction.rollout_is, actor.correction.rollout_is_threshold) == ("token", 2.0)
    assert actor.inputs == ("old_logprobs", "advantages", "ref_logprobs", "rollout_logprobs")
    assert (algo.critic_loss.cliprange_value, algo.critic_loss.inputs) == (0.3, ("values", "returns"))

    class RecordingPolicy:
        def __init__(self):
            self.losses = []

        def update(self, mini_batches, loss):
            self.losses.append(loss)
            return [{"actor/pg_loss": 1.0}]

    class Source:
        def after_update(self, step, *, updated):
            return {}

    policy = RecordingPolicy()
    trainer = PPOTrainer(
        config,
        roles=Roles(policy, None),
        tokenizer=None,
        data=None,
        rewards=None,
        tracker=None,
        total_steps=1,
    )
    trainer.source = Source()
    assert trainer.update_actor(config.critic.warmup_steps, []) == {}  # the warm-up: no update
    assert trainer.update_actor(config.critic.warmup_steps + 1, []) == {"actor/pg_loss": 1.0}
    assert policy.losses == [trainer.algorithm.actor_loss]
