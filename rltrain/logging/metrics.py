"""Metric names of one training step and small helpers that compute summary statistics.

A step's metrics are a flat ``dict[str, float]``; keys are slash-namespaced ``group/name`` (or
``group/quantity/statistic``) so TensorBoard groups them into sections, as verl does:

==================  ==========================================================================
group               keys (all per training step)
==================  ==========================================================================
``reward/``         ``score/{mean,std,min,max}`` rule score per sequence before any KL penalty;
                    ``accuracy`` fraction of correct answers; ``answered`` fraction with an
                    extractable answer; ``format/mean`` format-reward rate (if configured);
                    ``by_source/<data_source>/{score_mean,accuracy,count}``; with a reward model
                    ``model_score/{mean,std,min,max}`` (its scores) and ``total/...`` (the
                    weighted sum the advantages start from); with a custom, remote or code
                    reward ``extra/<key>/mean`` of the extra numbers it answers (``tests_passed``)
``response/``       ``length/{mean,min,max}`` response tokens; ``clip_ratio`` fraction that hit
                    ``max_response_length``
``prompt/``         ``length/{mean,min,max}`` prompt tokens
``actor/``          ``pg_loss``, ``entropy``, ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``
                    (old vs new policy), ``tis_weight_mean`` (with TIS), ``kl`` (policy vs
                    reference, per token), ``kl_coef`` (β), ``kl_seq_sum``, ``kl_loss``,
                    ``entropy_before_update``, ``loss``, ``grad_norm``, ``lr``, ``skipped_steps``,
                    ``param_max_abs`` (largest parameter magnitude after the update)
``critic/``         ``vf_loss``, ``vf_clipfrac``, ``vpred_mean``, ``loss``, ``grad_norm``, ``lr``,
                    ``skipped_steps``, ``param_max_abs``, ``values/mean``, ``advantages/mean``,
                    ``returns/mean``
``moe/``            MoE models, the actor's update passes (the critic's: ``critic/moe/``):
                    ``load_max_over_mean`` (tokens of the busiest expert / mean tokens per expert),
                    ``aux_loss`` and ``z_loss`` (Megatron-Core's, without coefficients; when
                    enabled), ``router_entropy``, ``expert_bias_abs_max`` (aux-loss-free routing);
                    with ``model.moe.moe_per_layer_logging`` each also as ``layer_<n>/<name>`` and
                    ``layer_<n>/tokens_per_expert_{max,min}``
                    (:mod:`rltrain.megatron.moe_metrics`)
``rollout/``        ``logprob_abs_diff_mean``, ``logprob_abs_diff_max`` |trainer - rollout|
                    logprob gap per response token, ``importance_ratio_mean`` (written by
                    :func:`rltrain.rollout.mismatch.logprob_mismatch`; DESIGN.md principle 6)
``rollout_corr/``   with ``algorithm.rollout_correction`` set, over the valid response tokens of
                    each optimizer step's whole mini-batch (all data-parallel ranks), averaged over
                    the update's steps: ``kl`` (mean log μ - log π_old: rollout vs trainer),
                    ``k3_kl`` (mean r - 1 - log r, r = π_old/μ), ``chi2_token`` (mean r² - 1);
                    ``rollout_is_{mean,max,min}`` and ``rollout_is_eff_sample_size`` ((Σw)²/(N Σw²))
                    of the IS weights w (r itself without ``rollout_is``),
                    ``rollout_is_ratio_fraction_high`` (truncated tokens; with ``rollout_is``);
                    ``rollout_rs_masked_fraction`` (tokens the rejection dropped),
                    ``rollout_rs_seq_masked_fraction`` (sequences with a dropped token)
                    (:meth:`rltrain.algo.rollout_correction.CorrectionStats.metrics`)
``weight_sync/``    ``seconds``, ``gbytes``, ``num_tensors``, ``checksum_mismatches``, ``verify_seconds`` (the
                    engine's readback and the comparison), ``verified_tensors`` (trainer side);
                    ``receive_seconds``, ``buckets`` (engines on other devices)
``val/``            ``accuracy``, ``score/mean`` on the held-out prompts (when evaluated)
``timing_s/``       seconds per stage, one key per name in :data:`STAGES`, plus ``step``
``perf/``           ``tokens_per_s`` (prompt + response tokens of the step / step seconds),
                    ``num_tokens``
``data/``           ``epoch``, ``num_filtered_prompts``
``agent/``          multi-turn rollouts (per trajectory, mean over the step): ``turns`` (assistant
                    turns), ``tool_calls``, ``tool_errors``, ``model_tokens``, ``tool_tokens``
                    (tokens by source); ``tool_error_rate`` (errors / calls), ``tool_latency_s``
                    (mean seconds of one call), ``aborted`` (past ``trajectory_timeout_s``)
==================  ==========================================================================

Statistics are population statistics (``std`` with ddof=0) over the sequences of the step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

REWARD_MEAN = "reward/score/mean"
REWARD_STD = "reward/score/std"
REWARD_ACCURACY = "reward/accuracy"
REWARD_ANSWERED = "reward/answered"
REWARD_FORMAT_MEAN = "reward/format/mean"
REWARD_MODEL_SCORE = "reward/model_score"
"""Prefix of the reward model's score stats (``/mean``, ``/std``, ``/min``, ``/max``), before weighting."""
REWARD_TOTAL = "reward/total"
"""Prefix of the stats of a sample's reward with a reward model (``reward.reward_model``'s weights)."""
RESPONSE_LENGTH_MEAN = "response/length/mean"
RESPONSE_CLIP_RATIO = "response/clip_ratio"
PROMPT_LENGTH_MEAN = "prompt/length/mean"
GRAD_NORM = "grad_norm"
LR = "lr"
SKIPPED_STEPS = "skipped_steps"
PARAM_MAX_ABS = "param_max_abs"
"""Names of an update step's ``<role>/grad_norm``, ``<role>/lr``, ``<role>/skipped_steps`` and
``<role>/param_max_abs``."""
ACTOR_PG_LOSS = "actor/pg_loss"
ACTOR_ENTROPY = "actor/entropy"
ACTOR_PG_CLIPFRAC = "actor/pg_clipfrac"
ACTOR_PG_CLIPFRAC_LOWER = "actor/pg_clipfrac_lower"
ACTOR_PPO_KL = "actor/ppo_kl"
ACTOR_TIS_WEIGHT_MEAN = "actor/tis_weight_mean"
ACTOR_KL = "actor/kl"
ACTOR_KL_COEF = "actor/kl_coef"
ACTOR_KL_SEQ_SUM = "actor/kl_seq_sum"
ACTOR_KL_LOSS = "actor/kl_loss"
ACTOR_MTP_LOSS = "actor/mtp_loss"
ACTOR_ENTROPY_BEFORE_UPDATE = "actor/entropy_before_update"
ACTOR_GRAD_NORM = "actor/" + GRAD_NORM
ACTOR_LR = "actor/" + LR
ACTOR_SKIPPED_STEPS = "actor/" + SKIPPED_STEPS
CRITIC_VF_LOSS = "critic/vf_loss"
CRITIC_VF_CLIPFRAC = "critic/vf_clipfrac"
CRITIC_VPRED_MEAN = "critic/vpred_mean"
CRITIC_GRAD_NORM = "critic/" + GRAD_NORM
CRITIC_LR = "critic/" + LR
CRITIC_SKIPPED_STEPS = "critic/" + SKIPPED_STEPS
CRITIC_VALUES_MEAN = "critic/values/mean"
CRITIC_ADVANTAGES_MEAN = "critic/advantages/mean"
CRITIC_RETURNS_MEAN = "critic/returns/mean"
ROLLOUT_LOGPROB_DIFF_MEAN = "rollout/logprob_abs_diff_mean"
ROLLOUT_LOGPROB_DIFF_MAX = "rollout/logprob_abs_diff_max"
ROLLOUT_CORR_KL = "rollout_corr/kl"
ROLLOUT_CORR_K3_KL = "rollout_corr/k3_kl"
ROLLOUT_CORR_CHI2_TOKEN = "rollout_corr/chi2_token"
ROLLOUT_CORR_IS_MEAN = "rollout_corr/rollout_is_mean"
ROLLOUT_CORR_IS_MAX = "rollout_corr/rollout_is_max"
ROLLOUT_CORR_IS_MIN = "rollout_corr/rollout_is_min"
ROLLOUT_CORR_IS_ESS = "rollout_corr/rollout_is_eff_sample_size"
ROLLOUT_CORR_IS_FRACTION_HIGH = "rollout_corr/rollout_is_ratio_fraction_high"
ROLLOUT_CORR_RS_MASKED_FRACTION = "rollout_corr/rollout_rs_masked_fraction"
ROLLOUT_CORR_RS_SEQ_MASKED_FRACTION = "rollout_corr/rollout_rs_seq_masked_fraction"
"""verl's ``rollout_corr/*`` names (``..._IS_FRACTION_HIGH`` only with ``rollout_is``)."""
ASYNC_STALENESS_MEAN = "async/staleness_mean"
ASYNC_STALENESS_MAX = "async/staleness_max"
ASYNC_ENGINE_VERSION = "async/engine_version"
ASYNC_BATCHES_AHEAD = "async/batches_ahead"
ASYNC_TRAINER_WAIT_S = "async/trainer_wait_s"
ASYNC_ENGINE_BUSY_S = "async/engine_busy_s"
ASYNC_ENGINE_IDLE_S = "async/engine_idle_s"
ASYNC_WEIGHT_SYNCS = "async/weight_syncs"
ASYNC_PARTIAL_SAMPLES = "async/partial_samples"
ASYNC_VERSION_SPREAD = "async/version_spread"
ASYNC_TOKEN_STALENESS_MEAN = "async/token_staleness_mean"
"""``trainer.pipeline`` one_step_off / fully_async (:mod:`rltrain.trainer.pipeline`): the
trained batch's staleness (policy versions it lags), the engines' version and batches queued on them
after the step, seconds the trainer waited for batches or idle engines (its idle time), seconds the
engines generated (their own clocks) and did not generate (the step's time less that), and weight
sends since the step before."""
PERF_TOKENS_PER_S = "perf/tokens_per_s"
PERF_NUM_TOKENS = "perf/num_tokens"
DATA_EPOCH = "data/epoch"
DATA_NUM_FILTERED = "data/num_filtered_prompts"
WEIGHT_SYNC_SECONDS = "weight_sync/seconds"
WEIGHT_SYNC_GBYTES = "weight_sync/gbytes"
WEIGHT_SYNC_NUM_TENSORS = "weight_sync/num_tensors"
WEIGHT_SYNC_CHECKSUM_MISMATCHES = "weight_sync/checksum_mismatches"
WEIGHT_SYNC_VERIFY_SECONDS = "weight_sync/verify_seconds"
WEIGHT_SYNC_VERIFIED_TENSORS = "weight_sync/verified_tensors"
WEIGHT_SYNC_RECEIVE_SECONDS = "weight_sync/receive_seconds"
WEIGHT_SYNC_BUCKETS = "weight_sync/buckets"
AGENT_TURNS = "agent/turns"
AGENT_TOOL_CALLS = "agent/tool_calls"
AGENT_TOOL_ERRORS = "agent/tool_errors"
AGENT_TOOL_SECONDS = "agent/tool_seconds"
AGENT_MODEL_TOKENS = "agent/model_tokens"
AGENT_TOOL_TOKENS = "agent/tool_tokens"
AGENT_TOOL_ERROR_RATE = "agent/tool_error_rate"
AGENT_ABORTED = "agent/aborted"
AGENT_TOOL_LATENCY = "agent/tool_latency_s"
VAL_ACCURACY = "val/accuracy"
VAL_SCORE_MEAN = "val/score/mean"
VAL_MODEL_SCORE_MEAN = "val/model_score/mean"
"""With ``reward.reward_model``: the reward model's mean score of the validation samples."""
VAL_TOTAL_MEAN = "val/total/mean"
"""With ``reward.reward_model``: the mean of ``score_weight`` × model + ``rule_weight`` × rule over
the validation samples, the reward training optimises; ``val/score/mean`` stays the rules' alone."""

TIMING_PREFIX = "timing_s/"
STAGES = (
    "generate",
    "reward",
    "old_logprob",
    "ref",
    "values",
    "advantages",
    "update_actor",
    "update_critic",
    "weight_sync",
)
"""The stages of one PPO step, in order; ``timing_s/step`` covers the whole step."""
TIMING_STEP = TIMING_PREFIX + "step"


def timing_key(stage: str) -> str:
    """``timing_s/<stage>``."""
    return TIMING_PREFIX + stage


def summary_stats(prefix: str, values: Sequence[float]) -> dict[str, float]:
    """``{prefix/mean, prefix/std, prefix/min, prefix/max}`` of ``values`` (population std)."""
    if not values:
        raise ValueError(f"cannot summarize {prefix!r}: no values")
    mean = math.fsum(values) / len(values)
    var = math.fsum((v - mean) ** 2 for v in values) / len(values)
    return {
        f"{prefix}/mean": mean,
        f"{prefix}/std": math.sqrt(var),
        f"{prefix}/min": float(min(values)),
        f"{prefix}/max": float(max(values)),
    }


def length_metrics(
    prompt_lengths: Sequence[int], response_lengths: Sequence[int], *, max_response_length: int
) -> dict[str, float]:
    """Prompt and response length statistics plus the fraction of responses cut at the limit."""
    metrics = summary_stats("prompt/length", prompt_lengths) | summary_stats(
        "response/length", response_lengths
    )
    metrics = {key: value for key, value in metrics.items() if not key.endswith("/std")}
    clipped = sum(1 for n in response_lengths if n >= max_response_length)
    metrics[RESPONSE_CLIP_RATIO] = clipped / len(response_lengths)
    return metrics


def throughput_metrics(*, num_tokens: int, step_seconds: float) -> dict[str, float]:
    """``perf/num_tokens`` and ``perf/tokens_per_s`` of one step."""
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be > 0, got {step_seconds}")
    return {PERF_NUM_TOKENS: float(num_tokens), PERF_TOKENS_PER_S: num_tokens / step_seconds}
