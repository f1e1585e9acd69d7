"""Every policy loss through the real update path equals the loss of the batch computed in one piece.

A real actor (``PolicyWorker``, tiny llama, Megatron on gloo, ``use_remove_padding``: packed
micro-batches) takes one update per case of ``policy_loss_cases.CASES`` (vanilla, gspo, cispo,
geo_mean, clip_cov, kl_cov, gpg, reinforce; token-mean, token-sum, seq-mean-token-mean,
seq-mean-token-sum-norm with ``loss_scale_factor``; the KL loss with the straight-through ``k3+``
and ``k1+``) on eight ragged responses split into three micro-batches (3, 3, 2 rows). The worker
reports each term summed over its micro-batches, each aggregated with the mini-batch's global
denominators.

Reference, computed here: ``rltrain.algo.compute_policy_loss`` on the whole batch in one piece
(local counts are then the global ones), from the log-probs the worker computed before the update
and the hand-written log-ratios of the cases module; the KL loss from its textbook formula; the
entropy bonus from the worker's entropies. clip_cov and kl_cov choose tokens by statistics of the
micro-batch they see (as verl's do), so their reference is the same function on each micro-batch
with the global denominators, summed; the test also shows that this differs from the one-piece
value on this batch. For the other losses it shows that averaging per-micro-batch means (local
denominators) would not pass, so the comparison can fail.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest
import torch
from dist_harness import run_ranks
from policy_loss_cases import (
    CASES,
    ENTROPY_COEFF,
    LOG_RATIO,
    MICRO_SPLITS,
    REF_LOG_RATIO,
    SAMPLED_MASK,
    LossCase,
    policy_loss_updates,
)

from rltrain.algo import LossAgg, PolicyLossInputs, PolicyLossParams, compute_policy_loss
from rltrain.logging import metrics as mk

pytestmark = pytest.mark.dist

TOL = 2e-6
"""Worker (float32 per micro-batch, float64 sum) vs reference (float64 from the same float32
inputs), relative to max(1, |value|)."""

_POLICY_METRICS = (mk.ACTOR_PG_LOSS, mk.ACTOR_PG_CLIPFRAC, mk.ACTOR_PG_CLIPFRAC_LOWER, mk.ACTOR_PPO_KL)


def _params(case: LossCase) -> PolicyLossParams:
    """The clip ranges and covariance settings of ``case`` (the section's fields carry verl's names
    in both)."""
    section = {k: v for k, v in asdict(case.policy_loss).items() if k != "loss_mode"}
    return PolicyLossParams(clip_ratio=case.clip_ratio, clip_ratio_high=case.clip_ratio_high, **section)


def _policy_terms(
    case: LossCase, tensors: dict[str, torch.Tensor], rows: list[int], agg: LossAgg
) -> dict[str, float]:
    """The policy-loss metrics of ``rows`` aggregated by ``agg``."""
    inputs = PolicyLossInputs(
        old_logprobs=tensors["old_logprobs"][rows],
        logprobs=tensors["logprobs"][rows],
        advantages=tensors["advantages"][rows],
        response_mask=tensors["mask"][rows],
    )
    out = compute_policy_loss(case.policy_loss.loss_mode, inputs, params=_params(case), agg=agg)
    values = (out.loss, out.clipfrac, out.clipfrac_lower, out.ppo_kl)
    return {key: float(value) for key, value in zip(_POLICY_METRICS, values)}


def _summed(parts: list[dict[str, float]]) -> dict[str, float]:
    return {key: sum(part[key] for part in parts) for key in parts[0]}


def _agg(case: LossCase, mask: torch.Tensor | None = None) -> LossAgg:
    """``case``'s aggregation; with ``mask``, that mask's counts as the global denominators."""
    counts = {}
    if mask is not None:
        counts = dict(global_num_tokens=float(mask.sum()), global_num_seqs=float((mask.sum(-1) > 0).sum()))
    return LossAgg(case.loss_agg_mode, loss_scale_factor=case.loss_scale_factor, **counts)


def _expected(case: LossCase, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    mask = tensors["mask"]
    if case.per_micro_batch:
        policy = _summed([_policy_terms(case, tensors, rows, _agg(case, mask=mask)) for rows in MICRO_SPLITS])
    else:
        policy = _policy_terms(case, tensors, list(range(mask.size(0))), _agg(case))
    entropy = tensors["entropy"]
    expected = policy | {mk.ACTOR_ENTROPY: float((entropy * mask).sum() / mask.sum())}
    loss = policy[mk.ACTOR_PG_LOSS] - ENTROPY_COEFF * float(_agg(case)(entropy, mask))
    if case.kl_loss_type is not None:
        # both '+' names keep their base estimator's value: k3 = e^-κ + κ - 1, k1 = κ (κ = logp - ref)
        kappa = tensors["logprobs"] - tensors["ref_logprobs"]
        kl_mat = {"k3+": torch.exp(-kappa) + kappa - 1, "k1+": kappa}[case.kl_loss_type]
        expected[mk.ACTOR_KL_LOSS] = float(_agg(case)(kl_mat, mask))
        loss += case.kl_loss_coef * expected[mk.ACTOR_KL_LOSS]
    expected["actor/loss"] = loss
    return expected


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= TOL * max(1.0, abs(want))


def test_policy_losses_through_megatron_equal_the_one_piece_reference(model_dir) -> None:
    (run,) = run_ranks(policy_loss_updates, 1, str(model_dir))
    assert [list(rows) for rows in run["splits"]] == [list(rows) for rows in MICRO_SPLITS]
    mask = torch.from_numpy(run["response_mask"]).double()
    assert torch.equal(mask, SAMPLED_MASK.double()) and int(mask.sum()) == 31
    advantages = torch.from_numpy(run["advantages"]).double()

    assert [case.name for case in CASES] == list(run["cases"])
    for case in CASES:
        result = run["cases"][case.name]
        tensors = {
            key: torch.from_numpy(result[key]).double()
            for key in ("logprobs", "entropy", "old_logprobs", "ref_logprobs")
        }
        tensors |= {"mask": mask, "advantages": advantages}
        # the log-ratios the loss saw are the hand-written ones (float32 rounding of logp - ℓ)
        log_ratio = tensors["logprobs"] - tensors["old_logprobs"]
        assert ((log_ratio - LOG_RATIO).abs() * mask).max() < 1e-5, case.name
        assert ((tensors["logprobs"] - tensors["ref_logprobs"] - REF_LOG_RATIO).abs() * mask).max() < 1e-5

        got, expected = result["metrics"], _expected(case, tensors)
        for key, value in expected.items():
            assert _close(got[key], value), (case.name, key, got[key], value)
        assert (mk.ACTOR_KL_LOSS in got) == (case.kl_loss_type is not None), case.name
        assert math.isfinite(got[mk.ACTOR_GRAD_NORM]) and got[mk.ACTOR_GRAD_NORM] > 0, case.name

        one_piece = _policy_terms(case, tensors, list(range(mask.size(0))), _agg(case))[mk.ACTOR_PG_LOSS]
        if case.per_micro_batch:
            # the micro-batch statistics decide: the one-piece loss is another number here
            assert not _close(got[mk.ACTOR_PG_LOSS], one_piece), (case.name, one_piece)
        elif case.loss_agg_mode != "token-sum":
            # a mean of per-micro-batch means (local denominators) would not pass
            local = [
                _policy_terms(case, tensors, rows, _agg(case))[mk.ACTOR_PG_LOSS] for rows in MICRO_SPLITS
            ]
            assert not _close(sum(local) / len(local), one_piece), case.name

    # the batch reaches the branches it is meant to: PPO's clip and dual clip, GSPO's sequence
    # clip, clip_cov's cut tokens and kl_cov's penalized ones (5: ⌊0.2 n⌋ of 14, 12 and 5 tokens)
    metrics = {name: result["metrics"] for name, result in run["cases"].items()}
    assert metrics["vanilla/token-mean"][mk.ACTOR_PG_CLIPFRAC] > 0
    assert metrics["vanilla/token-mean"][mk.ACTOR_PG_CLIPFRAC_LOWER] == pytest.approx(2 / 31)
    assert metrics["gspo"][mk.ACTOR_PG_CLIPFRAC] > 0
    assert metrics["clip_cov"][mk.ACTOR_PG_CLIPFRAC] > 0
    assert metrics["kl_cov"][mk.ACTOR_PG_CLIPFRAC] == pytest.approx(5 / 31)
