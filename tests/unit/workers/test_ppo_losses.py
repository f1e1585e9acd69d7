"""Loss callables: micro-batch sums equal the full mini-batch loss and a hand-computed reference;
the actor's policy-loss section, aggregation and KL settings from a recipe reach them."""

import math

import pytest
import torch

from rltrain.algo.loss_agg import GlobalCounts
from rltrain.algo.losses import PolicyLossParams
from rltrain.algo.token_batch import ModelOutput, TokenBatch
from rltrain.config import ActorConfig, CriticConfig, load_config
from rltrain.config.actor import PolicyLossConfig
from rltrain.config.algorithm import AlgorithmConfig
from rltrain.trainer.algorithms.losses import actor_loss_of, critic_loss_of
from rltrain.workers import ppo_losses
from rltrain.workers.ppo_losses import actor_loss_fn, critic_loss_fn


def micro(mask: torch.Tensor, **loss_inputs: torch.Tensor) -> TokenBatch:
    """A micro-batch whose rows are all response (``response_mask`` is ``mask``)."""
    ids = torch.zeros(mask.shape, dtype=torch.long)
    return TokenBatch(input_ids=ids, attention_mask=mask, response_len=mask.size(1), **loss_inputs)


def test_actor_loss_sums_over_micro_batches_to_token_mean():
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float32)
    old = torch.randn(4, 3) * 0.1 - 1
    new = old + torch.randn(4, 3) * 0.3
    adv = torch.randn(4, 3)
    ref = old - 0.05
    entropy = torch.rand(4, 3)
    cfg = ActorConfig(
        entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="kl", clip_ratio=0.2
    )
    fn = actor_loss_fn(actor_loss_of(cfg, AlgorithmConfig()), GlobalCounts.of(mask))
    full, _ = fn(
        ModelOutput(logprobs=new, entropy=entropy),
        micro(mask, old_logprobs=old, advantages=adv, ref_logprobs=ref),
    )
    total = torch.tensor(0.0)
    for rows in ([0], [1, 2], [3]):
        out = ModelOutput(logprobs=new[rows], entropy=entropy[rows])
        loss, _ = fn(
            out, micro(mask[rows], old_logprobs=old[rows], advantages=adv[rows], ref_logprobs=ref[rows])
        )
        total = total + loss
    torch.testing.assert_close(total, full)
    # Hand reference: token-mean PPO clip - 0.01·entropy + 0.1·k1.
    ratio = torch.exp(new - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * 3.0), pg)
    n = mask.sum()
    expected = (
        (pg * mask).sum() / n - 0.01 * (entropy * mask).sum() / n + 0.1 * ((new - ref) * mask).sum() / n
    )
    torch.testing.assert_close(full, expected)


def test_critic_loss_matches_clipped_value_loss_by_hand():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    values = torch.tensor([[0.0, 1.0], [2.0, 5.0]])
    vpreds = torch.tensor([[1.0, 1.0], [2.2, 9.0]])
    returns = torch.tensor([[1.0, 0.0], [3.0, 0.0]])
    fn = critic_loss_fn(
        critic_loss_of(CriticConfig(cliprange_value=0.5), ActorConfig()), GlobalCounts.of(mask)
    )
    loss, metrics = fn(ModelOutput(values=vpreds), micro(mask, values=values, returns=returns))
    # (0,0): clip(1, -0.5, 0.5)=0.5 -> max(0, 0.25)=0.25, clipped; (0,1): max(1, 1)=1;
    # (1,0): clip(2.2, 1.5, 2.5)=2.2 -> 0.64; (1,1) is padding.
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.25 + 1.0 + 0.64) / 3))
    torch.testing.assert_close(metrics["critic/vf_clipfrac"], torch.tensor(1 / 3))


def test_tool_tokens_of_a_multi_turn_response_get_exactly_zero_gradient():
    # response: model, model, tool, tool, model, padding (sampled mask 1 1 0 0 1 0)
    sampled = torch.tensor([[1, 1, 0, 0, 1, 0]])
    attended = torch.tensor([[1, 1, 1, 1, 1, 0]])
    batch = TokenBatch(
        input_ids=torch.arange(8).view(1, 8),
        attention_mask=torch.cat([torch.ones(1, 2, dtype=torch.long), attended], dim=1),
        response_len=6,
        old_logprobs=torch.full((1, 6), -1.0),
        ref_logprobs=torch.full((1, 6), -1.2),
        advantages=torch.tensor([[0.5, -0.3, 9.0, 9.0, 0.7, 0.0]]),
        sampled_mask=sampled,
    )
    cfg = ActorConfig(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    loss_fn = actor_loss_fn(actor_loss_of(cfg, AlgorithmConfig()), GlobalCounts.of(batch.response_mask))
    logprobs = torch.tensor([[-0.9, -1.1, -0.2, -3.0, -1.0, 0.0]], requires_grad=True)
    entropy = torch.tensor([[2.0, 2.1, 0.5, 0.4, 1.9, 0.0]], requires_grad=True)
    loss, metrics = loss_fn(ModelOutput(logprobs=logprobs, entropy=entropy), batch)
    loss.backward()
    assert logprobs.grad[0, 2:4].tolist() == [0.0, 0.0] and entropy.grad[0, 2:4].tolist() == [0.0, 0.0]
    assert all(g != 0.0 for g in logprobs.grad[0, [0, 1, 4]].tolist())
    # the token mean covers the three model tokens only: pg loss by hand (ratio within the clip range)
    ratio = torch.exp(logprobs.detach() - batch.old_logprobs)[0, [0, 1, 4]]
    expected_pg = float((-batch.advantages[0, [0, 1, 4]] * ratio).mean())
    assert abs(float(metrics["actor/pg_loss"]) - expected_pg) < 1e-6


RECIPE = """
model: {tiny: {}}
data: {generated: {num_train: 64}, train_batch_size: 8}
actor: {ppo_mini_batch_size: 4, ppo_micro_batch_size_per_gpu: 2}
critic: {ppo_micro_batch_size_per_gpu: 2}
"""
# a gap in row 0, an empty row 1; padding holds garbage
LOSS_MASK = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
LOGPROBS = torch.tensor([[-1.0, 5.0, -0.5], [5.0, 5.0, 5.0], [-2.0, -0.25, 5.0]], dtype=torch.float64)
ADVANTAGES = torch.tensor([[1.0, 9.0, 2.0], [9.0, 9.0, 9.0], [-0.5, 1.0, 9.0]], dtype=torch.float64)


def load_actor(tmp_path, overrides: list[str], actor_yaml: str = "") -> ActorConfig:
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE.replace("actor: {", "actor: {" + actor_yaml))
    return load_config(path, overrides).actor


def record_policy_loss_calls(monkeypatch) -> list[tuple[str, PolicyLossParams]]:
    """The ``(loss name, params)`` of every policy loss the actor's loss computes from now on."""
    seen = []
    real = ppo_losses.compute_policy_loss

    def spy(name, inputs, *, params, agg):
        seen.append((name, params))
        return real(name, inputs, params=params, agg=agg)

    monkeypatch.setattr(ppo_losses, "compute_policy_loss", spy)
    return seen


def test_tau_and_dro_beta_reach_the_policy_loss(monkeypatch):
    """sapo's ``actor.tau_pos/tau_neg`` and dro's ``actor.policy_loss.dro_beta`` reach the loss, and
    dro's value is its formula by hand: ``-(A logp - β/2 lr²)``, token-mean."""
    seen = record_policy_loss_calls(monkeypatch)
    cfg = ActorConfig(tau_pos=1.5, tau_neg=2.5, policy_loss=PolicyLossConfig(loss_mode="dro", dro_beta=0.5))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=torch.float64, requires_grad=True)
    batch = micro(
        mask,
        old_logprobs=logprobs.detach() - torch.tensor([[0.2, -0.4], [0.0, 0.0]], dtype=torch.float64),
        advantages=torch.tensor([[1.0, 1.0], [-0.5, 0.0]], dtype=torch.float64),
    )
    loss, _ = actor_loss_fn(actor_loss_of(cfg, AlgorithmConfig()), GlobalCounts.of(mask))(
        ModelOutput(logprobs, torch.zeros(2, 2)), batch
    )
    assert seen == [("dro", PolicyLossParams(tau_pos=1.5, tau_neg=2.5, dro_beta=0.5))]
    # -(A logp - 0.25 lr²): 1 + 0.01, 2 + 0.04, -0.25; mean over 3 tokens
    assert loss.item() == pytest.approx((1.01 + 2.04 - 0.25) / 3, rel=1e-12)


def run_actor(cfg: ActorConfig, ref_logprobs: torch.Tensor | None = None):
    logprobs = LOGPROBS.clone().requires_grad_()
    batch = micro(LOSS_MASK, old_logprobs=LOGPROBS - 0.1, advantages=ADVANTAGES, ref_logprobs=ref_logprobs)
    loss, metrics = actor_loss_fn(actor_loss_of(cfg, AlgorithmConfig()), GlobalCounts.of(LOSS_MASK))(
        ModelOutput(logprobs, torch.zeros(3, 3)), batch
    )
    loss.backward()
    return loss, metrics, logprobs.grad


@pytest.mark.parametrize(
    ("overrides", "actor_yaml", "loss_mode"),
    [
        ([], "", "vanilla"),
        ([], "policy_loss: gspo, ", "gspo"),
        (["actor.policy_loss=cispo"], "", "cispo"),
        (["actor.policy_loss.loss_mode=geo_mean"], "", "geo_mean"),
        ([], "policy_loss: {loss_mode: clip_cov, clip_cov_ratio: 0.3, clip_cov_lb: 0.5}, ", "clip_cov"),
        (["actor.policy_loss.loss_mode=kl_cov", "actor.policy_loss.kl_cov_ratio=0.5"], "", "kl_cov"),
        (
            ["actor.policy_loss.ppo_kl_coef=0.7", "actor.policy_loss.clip_cov_ub=6"],
            "policy_loss: {loss_mode: gpg}, ",
            "gpg",
        ),
        (["actor.policy_loss=reinforce", "actor.clip_ratio_high=0.28"], "", "reinforce"),
    ],
)
def test_policy_loss_section_reaches_the_actor_loss(tmp_path, monkeypatch, overrides, actor_yaml, loss_mode):
    seen = record_policy_loss_calls(monkeypatch)
    cfg = load_actor(tmp_path, overrides, actor_yaml)
    loss, metrics, _ = run_actor(cfg)
    settings = {
        "clip_cov": {"clip_cov_ratio": 0.3, "clip_cov_lb": 0.5},
        "kl_cov": {"kl_cov_ratio": 0.5},
        "gpg": {"ppo_kl_coef": 0.7, "clip_cov_ub": 6.0},
        "reinforce": {"clip_ratio_high": 0.28},
    }.get(loss_mode, {})
    assert seen == [(loss_mode, PolicyLossParams(**settings))]
    assert float(metrics["actor/pg_loss"]) == loss.item()


def test_gpg_with_token_sum_loss_scale_factor_and_straight_through_kl(tmp_path):
    ref = LOGPROBS - torch.tensor([[0.5, 0.0, -1.0], [0.0, 0.0, 0.0], [0.25, 0.5, 0.0]], dtype=torch.float64)
    overrides = ["actor.policy_loss=gpg", "actor.loss_agg_mode=token-sum", "actor.use_kl_loss=true"]
    cfg = load_actor(tmp_path, [*overrides, "actor.kl_loss_type=k3+", "actor.kl_loss_coef=0.5"])
    loss, metrics, grad = run_actor(cfg, ref_logprobs=ref)
    # -A·logp on the valid tokens: 1, 1, -1, 0.25; k3 of logp - ref = 0.5, -1, 0.25, 0.5
    k3 = [math.exp(-d) + d - 1 for d in (0.5, -1.0, 0.25, 0.5)]
    assert float(metrics["actor/pg_loss"]) == pytest.approx(1 + 1 - 1 + 0.25, rel=1e-12)
    assert loss.item() == pytest.approx(1.25 + 0.5 * sum(k3), rel=1e-12)
    # token-sum: -A + 0.5·(logp - ref), k2's gradient for the KL
    assert grad.tolist() == [[-0.75, 0.0, -2.5], [0.0, 0.0, 0.0], [0.625, -0.75, 0.0]]


@pytest.mark.parametrize(("overrides", "scale"), [([], 3), (["actor.loss_scale_factor=8"], 8)])
def test_loss_scale_factor_divides_each_sequence_sum_in_seq_mean_token_sum_norm(tmp_path, overrides, scale):
    cfg = load_actor(
        tmp_path, ["actor.policy_loss=gpg", "actor.loss_agg_mode=seq-mean-token-sum-norm", *overrides]
    )
    loss, _, _ = run_actor(cfg)
    # sequence sums of -A·logp: 1 + 1 and -1 + 0.25 over the 2 non-empty rows; null: padded width 3
    assert loss.item() == pytest.approx((2.0 / scale + -0.75 / scale) / 2, rel=1e-12)


def test_critic_loss_scale_factor(tmp_path):
    cfg = CriticConfig(cliprange_value=10.0, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=4)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    values = torch.zeros(2, 2)
    returns = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    loss, _ = critic_loss_fn(critic_loss_of(cfg, ActorConfig()), GlobalCounts.of(mask))(
        ModelOutput(values=values), micro(mask, values=values, returns=returns)
    )
    # 0.5 · mean over 2 sequences of (1 + 4) / 4 and 9 / 4
    torch.testing.assert_close(loss, torch.tensor(0.5 * (5 / 4 + 9 / 4) / 2))


@pytest.mark.parametrize(("critic_scale", "actor_scale", "scale"), [(None, 8, 8), (None, None, 2), (4, 8, 4)])
def test_critic_loss_scale_factor_falls_back_to_the_actors(critic_scale, actor_scale, scale):
    cfg = CriticConfig(
        cliprange_value=10.0, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=critic_scale
    )
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    values = torch.zeros(2, 2)
    returns = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    loss, _ = critic_loss_fn(
        critic_loss_of(cfg, ActorConfig(loss_scale_factor=actor_scale)), GlobalCounts.of(mask)
    )(ModelOutput(values=values), micro(mask, values=values, returns=returns))
    # squared errors 0.5 · (1 + 4) and 0.5 · 9 per sequence, each over C = scale (2: the padded width)
    torch.testing.assert_close(loss, torch.tensor(0.5 * (5 / scale + 9 / scale) / 2))
