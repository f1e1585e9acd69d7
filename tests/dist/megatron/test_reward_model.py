"""The Megatron reward model (``role="reward"``) scores what the HF sequence classifier it was loaded
from scores.

A tiny ``LlamaForSequenceClassification`` learns a synthetic preference with the Bradley–Terry loss
(and must rank held-out pairs), is saved with ``save_pretrained``, then loaded through the bridge as
the Megatron reward model on two gloo ranks: its score of each row (the scalar head at the last real
token) must equal HF's own (right-padded rows, its pooling at the last non-pad token) at TP=1/DP=2,
TP=2 with sequence parallelism, TP=2 with dynamic micro-batches and PP=2; the Megatron rows are in the
trainer's layout (left-padded prompt, right-padded response), one with an empty response.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from dist_harness import run_ranks
from reward_model_cases import (
    LAYOUTS,
    hf_scores,
    pair_accuracy,
    preference_pairs,
    reward_model_config,
    reward_scores_case,
    token_batch,
    train_bradley_terry,
)

from rltrain.algo.token_batch import TokenBatch

pytestmark = pytest.mark.dist
TOL = 1e-5


@dataclass(frozen=True)
class TrainedRewardModel:
    model_dir: Path
    untrained_accuracy: float
    accuracy: float
    """On held-out pairs, after training."""
    losses: list[float]
    batch: TokenBatch
    """Rows to score in the trainer's layout."""
    hf_scores: torch.Tensor
    """[batch] the HF model's scores of the same rows."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> TrainedRewardModel:
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(0)
    model = LlamaForSequenceClassification(reward_model_config()).float().eval()
    train, held_out = preference_pairs(256, seed=0), preference_pairs(64, seed=1)
    untrained = pair_accuracy(model, held_out)
    losses = train_bradley_terry(model, train, steps=30, batch_size=32, lr=3e-3)
    accuracy = pair_accuracy(model, held_out)
    model_dir = tmp_path_factory.mktemp("reward_model")
    model.save_pretrained(model_dir)

    rows = [(p.prompt, r) for p in held_out[:6] for r in (p.chosen, p.rejected)]
    rows += [(held_out[6].prompt, [])]  # scored at its last prompt token
    rows += [(held_out[7].prompt, [5] * max(len(r) for _, r in rows))]  # fills every response column
    with torch.no_grad():
        reference = hf_scores(model, [p + r for p, r in rows])
    return TrainedRewardModel(
        model_dir, untrained, accuracy, losses, token_batch(rows, odd_length=True), reference
    )


def test_bradley_terry_training_ranks_held_out_pairs(trained: TrainedRewardModel) -> None:
    print(
        f"held-out pair accuracy: untrained {trained.untrained_accuracy:.3f}, trained {trained.accuracy:.3f}; "
        f"loss {trained.losses[0]:.4f} -> {trained.losses[-1]:.4f}"
    )
    assert trained.untrained_accuracy < 0.7
    assert trained.accuracy >= 0.95


def test_megatron_reward_model_scores_equal_hf(trained: TrainedRewardModel) -> None:
    assert trained.batch.input_ids.size(1) % 2 == 1  # sequence parallelism must pad the prompt side
    spread = float(trained.hf_scores.max() - trained.hf_scores.min())
    assert spread > 1.0, f"HF scores barely differ ({spread:.3g}): the comparison would be weak"
    results = run_ranks(reward_scores_case, 2, str(trained.model_dir), trained.batch)
    for rank, per_layout in enumerate(results):
        assert sorted(per_layout) == sorted(LAYOUTS)
        for name, (rows, dtype, scores) in per_layout.items():
            assert dtype == "torch.float32" and len(scores) == len(rows)
            diff = float((torch.tensor(scores) - trained.hf_scores[rows]).abs().max())
            print(f"rank {rank} {name}: rows {rows[0]}..{rows[-1]}, max |Megatron - HF| {diff:.3g}")
            assert diff < TOL, f"rank {rank} {name}: max diff {diff:.3g} ≥ {TOL}"
