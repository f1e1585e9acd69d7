"""Loss callables: micro-batch sums equal the full mini-batch loss and a hand-computed reference."""

import torch

from rltrain.algo.token_batch import ModelOutput, TokenBatch
from rltrain.config import ActorConfig, CriticConfig
from rltrain.orchestrator.ppo_losses import GlobalCounts, actor_loss_fn, critic_loss_fn


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
    fn = actor_loss_fn(cfg, GlobalCounts.of(mask))
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
    fn = critic_loss_fn(CriticConfig(cliprange_value=0.5), GlobalCounts.of(mask))
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
    loss_fn = actor_loss_fn(cfg, GlobalCounts.of(batch.response_mask))
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
