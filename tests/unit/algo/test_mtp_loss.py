"""The MTP loss (:mod:`rltrain.algo.mtp_loss`): which response tokens each MTP layer predicts, the
loss against hand-computed values, and its share of the actor loss summing over micro-batches to the
mini-batch's."""

import torch

from rltrain.algo.loss_agg import GlobalCounts, LossAgg
from rltrain.algo.loss_specs import ActorLoss
from rltrain.algo.losses import PolicyLossParams
from rltrain.algo.mtp_loss import mtp_loss, mtp_response_mask
from rltrain.algo.token_batch import ModelOutput, TokenBatch
from rltrain.logging import metrics as mk
from rltrain.workers.ppo_losses import actor_loss_fn

# [prompt 3 | response 3]: row 0 a 1-token prompt (2 columns of left padding), row 1 a full row with
# the last response token padding, row 2 a 2-token prompt.
ATTENTION = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]])


def test_each_mtp_layer_predicts_the_response_tokens_with_a_real_token_k_plus_2_before():
    response = ATTENTION[:, -3:]
    # layer 0 reads the column 2 before: response column 3 needs column 1 (padding in rows 0 and 2)
    assert mtp_response_mask(ATTENTION, response, depth=0).tolist() == [[0, 1, 1], [1, 1, 0], [1, 1, 1]]
    # layer 1 reads 3 before: column 3 needs column 0, column 4 column 1
    assert mtp_response_mask(ATTENTION, response, depth=1).tolist() == [[0, 0, 1], [1, 1, 0], [0, 1, 1]]


def test_mtp_loss_is_the_mean_over_layers_of_the_masked_token_mean_cross_entropy():
    logprobs = -torch.arange(1.0, 19.0).view(2, 3, 3)  # [layer, batch, response]
    response = ATTENTION[:, -3:].float()
    agg = LossAgg("token-mean", global_num_tokens=8.0)
    # layer 0: tokens (0,1),(0,2),(1,0),(1,1),(2,0),(2,1),(2,2): 2+3+4+5+7+8+9 = 38
    # layer 1: tokens (0,2),(1,0),(1,1),(2,1),(2,2): 12+13+14+17+18 = 74
    expected = (38 / 8 + 74 / 8) / 2
    assert mtp_loss(logprobs, ATTENTION, response, agg).item() == expected


def test_the_actor_loss_adds_the_weighted_mtp_loss_and_its_micro_batch_shares_add_up():
    torch.manual_seed(0)
    batch = TokenBatch(
        input_ids=torch.zeros(3, 6, dtype=torch.long),
        attention_mask=ATTENTION,
        response_len=3,
        old_logprobs=torch.randn(3, 3),
        advantages=torch.randn(3, 3),
    )
    mask = batch.response_mask
    logprobs, mtp_logprobs = batch.old_logprobs + 0.1, -torch.rand(1, 3, 3) * 5
    spec = ActorLoss("vanilla", PolicyLossParams(), "token-mean", None, mtp_loss_scaling_factor=0.5)
    counts = GlobalCounts.of(mask)
    fn = actor_loss_fn(spec, counts)
    full, metrics = fn(
        ModelOutput(logprobs=logprobs, entropy=torch.zeros(3, 3), mtp_logprobs=mtp_logprobs), batch
    )
    layer_mask = mtp_response_mask(ATTENTION, mask, depth=0)
    hand = -(mtp_logprobs[0] * layer_mask).sum() / mask.sum()
    torch.testing.assert_close(metrics[mk.ACTOR_MTP_LOSS], hand)
    torch.testing.assert_close(full, metrics[mk.ACTOR_PG_LOSS] + 0.5 * hand)
    total = torch.tensor(0.0)
    for rows in ([0], [1, 2]):
        part = ModelOutput(
            logprobs=logprobs[rows], entropy=torch.zeros(len(rows), 3), mtp_logprobs=mtp_logprobs[:, rows]
        )
        total = total + fn(part, batch.select(rows))[0]
    torch.testing.assert_close(total, full)
    # the default spec ignores the MTP outputs and logs no MTP loss
    default = actor_loss_fn(ActorLoss("vanilla", PolicyLossParams(), "token-mean", None), counts)
    loss, metrics = default(ModelOutput(logprobs=logprobs, entropy=torch.zeros(3, 3)), batch)
    assert mk.ACTOR_MTP_LOSS not in metrics and torch.equal(loss, metrics[mk.ACTOR_PG_LOSS])
    torch.testing.assert_close(loss, full - 0.5 * hand)
