"""The actor loss with rollout correction: rejection equals training on the kept rows alone, TIS stays
bit-identical to the loss's own TIS, and the config resolves to the right correction."""

from dataclasses import replace

import pytest
import torch

from rltrain.algo.loss_agg import GlobalCounts, LossAgg
from rltrain.algo.losses import PolicyLossInputs, PolicyLossParams, compute_policy_loss
from rltrain.algo.rollout_correction import RolloutCorrectionSpec, correction_stats, parse_rejection
from rltrain.algo.token_batch import ModelOutput, TokenBatch
from rltrain.config import ActorConfig
from rltrain.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
from rltrain.trainer.algorithms.losses import actor_correction, actor_loss_of
from rltrain.workers.ppo_losses import actor_loss_fn

MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
ROLLOUT = torch.tensor([[-1.0, -0.5, 0.0], [-2.0, -0.3, -0.9], [-0.2, -1.1, -0.4], [-0.8, 0.0, 0.0]])
# ℓ sums per row: 0.15, -0.1, 1.2 (ratio 3.32, outside [0.5, 2]), 0.3
OLD = ROLLOUT + torch.tensor([[0.1, 0.05, 0.0], [-0.2, 0.1, 0.0], [0.5, 0.4, 0.3], [0.3, 0.0, 0.0]])
NEW = OLD + torch.tensor([[0.2, -0.1, 0.0], [0.05, 0.3, -0.25], [0.1, 0.1, 0.1], [-0.3, 0.0, 0.0]])
ADV = torch.tensor([[1.0, 1.0, 0.0], [-0.5, -0.5, -0.5], [2.0, 2.0, 2.0], [0.7, 0.0, 0.0]])
REF = OLD - 0.1
ENTROPY = torch.tensor([[1.0, 0.9, 0.0], [1.2, 1.1, 1.0], [0.3, 0.2, 0.1], [0.8, 0.0, 0.0]])


def micro(rows: list[int], **extra: torch.Tensor) -> TokenBatch:
    mask = MASK[rows]
    return TokenBatch(
        input_ids=torch.zeros(mask.shape, dtype=torch.long),
        attention_mask=mask,
        response_len=mask.size(1),
        old_logprobs=OLD[rows],
        advantages=ADV[rows],
        ref_logprobs=REF[rows],
        **extra,
    )


def output(rows: list[int]) -> ModelOutput:
    return ModelOutput(logprobs=NEW[rows], entropy=ENTROPY[rows])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_sequence_rejection_equals_the_loss_over_the_remaining_sequences(mode):
    cfg = ActorConfig(loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    spec = RolloutCorrectionSpec(rejection=parse_rejection("seq_sum_k1", "0.5_2.0"))
    stats = correction_stats(OLD, ROLLOUT, MASK, spec)
    assert (stats.kept_tokens, stats.kept_seqs) == (6, 3)
    counts = GlobalCounts.of(MASK).kept(stats)
    fn = actor_loss_fn(replace(actor_loss_of(cfg, AlgorithmConfig()), correction=spec), counts)
    rows = [0, 1, 2, 3]
    full, _ = fn(output(rows), micro(rows, rollout_logprobs=ROLLOUT))
    # micro-batches still add up to the mini-batch loss
    halves = sum(fn(output(r), micro(r, rollout_logprobs=ROLLOUT[r]))[0] for r in ([0, 2], [1, 3]))
    torch.testing.assert_close(halves, full)

    kept = [0, 1, 3]  # row 2 is out of bounds: an uncorrected loss over the other rows alone
    reference, _ = actor_loss_fn(actor_loss_of(cfg, AlgorithmConfig()), GlobalCounts.of(MASK[kept]))(
        output(kept), micro(kept)
    )
    torch.testing.assert_close(full, reference, rtol=1e-6, atol=1e-7)
    assert (
        abs(
            float(full)
            - float(
                actor_loss_fn(actor_loss_of(cfg, AlgorithmConfig()), GlobalCounts.of(MASK))(
                    output(rows), micro(rows)
                )[0]
            )
        )
        > 1e-3
    )


def test_tis_cap_alone_keeps_the_loss_and_its_metrics_bit_identical():
    cfg = ActorConfig(tis_imp_ratio_cap=1.2)
    correction = actor_correction(cfg, AlgorithmConfig())
    assert correction.spec == RolloutCorrectionSpec("token", 1.2) and not correction.log_metrics
    counts = GlobalCounts.of(MASK)
    loss, metrics = actor_loss_fn(
        replace(actor_loss_of(cfg, AlgorithmConfig()), correction=correction.spec), counts
    )(output([0, 1, 2, 3]), micro([0, 1, 2, 3], rollout_logprobs=ROLLOUT))
    legacy = compute_policy_loss(
        "vanilla",
        PolicyLossInputs(
            old_logprobs=OLD, logprobs=NEW, advantages=ADV, response_mask=MASK, rollout_logprobs=ROLLOUT
        ),
        params=PolicyLossParams(tis_cap=1.2),
        agg=LossAgg("token-mean", global_num_tokens=counts.num_tokens),
    )
    assert torch.equal(loss, legacy.loss)
    assert torch.equal(metrics["actor/tis_weight_mean"], legacy.tis_weight_mean)


def test_the_config_resolves_to_one_correction():
    assert actor_correction(ActorConfig(), AlgorithmConfig()) is None
    section = AlgorithmConfig(rollout_correction=RolloutCorrectionConfig())
    diagnostics_only = actor_correction(ActorConfig(), section)
    assert diagnostics_only.spec == RolloutCorrectionSpec() and diagnostics_only.log_metrics
    # the older key fills in a section that names no IS level
    assert actor_correction(ActorConfig(tis_imp_ratio_cap=3.0), section).spec == RolloutCorrectionSpec(
        "token", 3.0
    )
    seq = AlgorithmConfig(
        rollout_correction=RolloutCorrectionConfig(
            rollout_is="sequence",
            rollout_is_threshold=5.0,
            rollout_rs="seq_mean_k1",
            rollout_rs_threshold=1.01,
        )
    )
    spec = actor_correction(ActorConfig(), seq).spec
    assert spec.rollout_is == "sequence" and spec.rollout_is_threshold == 5.0
    assert spec.rejection == parse_rejection("seq_mean_k1", "0.9900990099009901_1.01")
