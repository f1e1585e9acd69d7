"""sapo's and dro's keys reach the policy loss: ``actor_loss_fn`` builds ``PolicyLossParams`` with
``actor.tau_pos``, ``actor.tau_neg`` and ``actor.policy_loss.dro_beta``, and the loss it returns
is the registered one's (dro by hand: ``-(A logp - β/2 lr²)``, token mean)."""

import pytest
import torch

from rltrain.algo.losses import PolicyLossParams
from rltrain.algo.token_batch import ModelOutput, TokenBatch
from rltrain.config import ActorConfig
from rltrain.config.actor import PolicyLossConfig
from rltrain.orchestrator import ppo_losses
from rltrain.orchestrator.ppo_losses import GlobalCounts, actor_loss_fn


def test_tau_and_dro_beta_reach_the_policy_loss(monkeypatch):
    seen = []
    real = ppo_losses.compute_policy_loss

    def spy(name, inputs, *, params, agg):
        seen.append((name, params))
        return real(name, inputs, params=params, agg=agg)

    monkeypatch.setattr(ppo_losses, "compute_policy_loss", spy)
    cfg = ActorConfig(tau_pos=1.5, tau_neg=2.5, policy_loss=PolicyLossConfig(loss_mode="dro", dro_beta=0.5))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=torch.float64, requires_grad=True)
    batch = TokenBatch(
        input_ids=torch.zeros((2, 2), dtype=torch.long),
        attention_mask=mask,
        response_len=2,
        old_logprobs=logprobs.detach() - torch.tensor([[0.2, -0.4], [0.0, 0.0]], dtype=torch.float64),
        advantages=torch.tensor([[1.0, 1.0], [-0.5, 0.0]], dtype=torch.float64),
    )
    loss, _ = actor_loss_fn(cfg, GlobalCounts.of(mask))(ModelOutput(logprobs, torch.zeros(2, 2)), batch)
    assert seen == [("dro", PolicyLossParams(tau_pos=1.5, tau_neg=2.5, dro_beta=0.5))]
    # -(A logp - 0.25 lr²): 1 + 0.01, 2 + 0.04, -0.25; mean over 3 tokens
    assert loss.item() == pytest.approx((1.01 + 2.04 - 0.25) / 3, rel=1e-12)
