"""Rollout correction: importance weights and rejection masks for the engine-vs-trainer gap.

The rollout engine samples with its own kernels (and possibly stale weights): its behaviour
log-probs ``log μ`` differ from the trainer's ``log π_old`` on the same tokens. With the per-token
log-ratio ``ℓ = log π_old - log μ`` (detached; ``r = exp ℓ``) this module computes, per row of
``[batch, response_len]`` tensors, following verl's ``algorithm.rollout_correction``
(``verl/trainer/ppo/rollout_corr_helper.py``, ``verl/trainer/config/algorithm.py``):

- IS weights (``rollout_is``): ``token``: ``min(r_t, C)`` (truncated IS, TIS; Yao et al. 2025);
  ``sequence``: ``min(exp(Σ_t ℓ_t), C)`` over the row's valid tokens, broadcast to its tokens.
  ``C = rollout_is_threshold``. Log-ratios are clamped to at most ``20`` before ``exp``.
- Rejection (``rollout_rs``, IcePop-style masking): each option is a per-token statistic
  ``k1 = ℓ``, ``k2 = ½ ℓ²``, ``k3 = r - 1 - ℓ`` aggregated as ``token`` (each token alone),
  ``seq_sum``, ``seq_mean`` or ``seq_max`` (over the row's valid tokens). ``k1`` options keep a
  token / row when the ratio lies in ``[lower, upper]``: ``token_k1`` bounds ``r_t``,
  ``seq_sum_k1`` the sequence ratio ``Π_t r_t``, ``seq_mean_k1`` its geometric mean
  ``exp(mean_t ℓ_t)``. ``k2``/``k3`` options keep it when the divergence is ``<= upper``;
  ``seq_max_k*`` rejects a whole row when any one token exceeds the bound (verl's successor of its
  per-token veto). Several options (comma-separated) must all pass. Rejected tokens leave the loss:
  the caller multiplies the response mask by the keep mask and counts its denominators on it.

Departure from verl: verl's code compares ``-ℓ`` against ``[log lower, log upper]`` for the ``k1``
options, i.e. keeps ``r ∈ [1/upper, 1/lower]``; here the documented ratio interval ``[lower,
upper]`` is used. The two agree for reciprocal bounds (verl's default when one number is given).

Diagnostics (:class:`CorrectionStats`) are additive sums and maxima over the valid tokens of a
batch, so that parts of a batch (micro-batches, data-parallel ranks) merge exactly (sum the sums,
max the maxima) before :meth:`CorrectionStats.metrics` turns them into verl's ``rollout_corr/*``
metrics. Pure tensor math: no collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rltrain.algo.masked import masked_mean, masked_sum

MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to at most this before ``exp`` (exp(20) ≈ 4.9e8), as in verl and TIS; the
policy loss clamps its ratio to ±this too, so that a diverged token cannot overflow."""

IS_LEVELS = ("token", "sequence")
"""Values of ``rollout_is``."""

_STATISTICS = ("k1", "k2", "k3")
_AGGREGATIONS = ("token", "seq_sum", "seq_mean", "seq_max")
RS_OPTIONS = tuple(
    f"{agg}_{stat}"
    for agg in _AGGREGATIONS
    for stat in _STATISTICS
    if not (agg == "seq_max" and stat == "k1")
)
"""Values of one ``rollout_rs`` option (verl's ``SUPPORTED_ROLLOUT_RS_OPTIONS``)."""

METRIC_PREFIX = "rollout_corr/"


@dataclass(frozen=True)
class RejectionBound:
    """One rejection option and its bounds."""

    option: str
    """A name in ``RS_OPTIONS``, e.g. ``seq_mean_k1``."""

    upper: float
    """Largest kept ratio (``*_k1``) or divergence (``k2``/``k3``)."""

    lower: float | None = None
    """Smallest kept ratio (``*_k1`` only, 0 for no lower bound; ``None`` for ``k2``/``k3``)."""


@dataclass(frozen=True)
class RolloutCorrectionSpec:
    """What to correct; built from ``algorithm.rollout_correction`` (and ``actor.tis_imp_ratio_cap``)."""

    rollout_is: str | None = None
    """``token``, ``sequence`` or ``None`` (no weights)."""

    rollout_is_threshold: float = 2.0
    """Upper truncation ``C`` of the IS weights."""

    rejection: tuple[RejectionBound, ...] = ()
    """Rejection options, all of which must pass."""

    def __post_init__(self) -> None:
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"rollout_is must be one of {list(IS_LEVELS)} or null, got {self.rollout_is!r}")
        if not (math.isfinite(self.rollout_is_threshold) and self.rollout_is_threshold > 0):
            raise ValueError(f"rollout_is_threshold must be finite and > 0, got {self.rollout_is_threshold}")


def parse_rejection(
    rollout_rs: str | None, rollout_rs_threshold: str | float | int | None
) -> tuple[RejectionBound, ...]:
    """verl's ``rollout_rs`` / ``rollout_rs_threshold`` pair as bounds.

    ``rollout_rs``: comma-separated options (duplicates dropped). ``rollout_rs_threshold``: one spec
    for all options or one per option, comma-separated; a ``k1`` spec is ``"lower_upper"`` or one
    number ``u`` (then ``lower = 1/u``), ``0 <= lower < upper``; a ``k2``/``k3`` spec is one positive number. Raises
    ``ValueError`` naming the bad part.
    """
    if rollout_rs is None:
        return ()
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    if not options:
        raise ValueError("rollout_rs names no option")
    for option in options:
        if option not in RS_OPTIONS:
            raise ValueError(f"rollout_rs option {option!r} is not one of {list(RS_OPTIONS)}")
    if rollout_rs_threshold is None:
        raise ValueError(f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold")
    specs = [s.strip() for s in str(rollout_rs_threshold).split(",") if s.strip()]
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ValueError(
            f"rollout_rs_threshold gives {len(specs)} thresholds for {len(options)} rollout_rs options"
        )
    return tuple(_bound(option, spec) for option, spec in zip(options, specs))


def _number(text: str, option: str, *, zero_ok: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"rollout_rs_threshold {text!r} of {option} is not a number") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise ValueError(
            f"rollout_rs_threshold of {option} must be finite and {'>=' if zero_ok else '>'} 0, got {text}"
        )
    return value


def _bound(option: str, spec: str) -> RejectionBound:
    if not option.endswith("k1"):
        if "_" in spec:
            raise ValueError(f"rollout_rs_threshold of {option} is one upper bound, got {spec!r}")
        return RejectionBound(option, upper=_number(spec, option))
    lower_text, _, upper_text = spec.rpartition("_") if "_" in spec else ("", "", spec)
    upper = _number(upper_text, option)
    lower = _number(lower_text, option, zero_ok=True) if lower_text else 1.0 / upper
    if not lower < upper:
        raise ValueError(f"rollout_rs_threshold of {option} needs lower < upper, got {spec!r}")
    return RejectionBound(option, upper=upper, lower=lower)


def log_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    """``[batch, response_len]`` detached ``ℓ = log π_old - log μ``."""
    return (old_logprobs - rollout_logprobs).detach()


def is_weights(ratio_log: torch.Tensor, mask: torch.Tensor, *, level: str, threshold: float) -> torch.Tensor:
    """``[batch, response_len]`` truncated IS weights of ``level`` (``token`` or ``sequence``).

    ``token`` is exactly the TIS weight ``min(exp(min(ℓ, 20)), C)``; ``sequence`` gives every token
    of a row ``min(exp(min(Σ_valid ℓ, 20)), C)``. Padding holds finite values the mask removes.
    """
    if level == "token":
        return torch.exp(ratio_log.clamp(max=MAX_LOG_RATIO)).clamp(max=threshold)
    if level == "sequence":
        seq = masked_sum(ratio_log, mask, dim=-1).clamp(max=MAX_LOG_RATIO)
        return torch.exp(seq).clamp(max=threshold).unsqueeze(-1).expand_as(ratio_log)
    raise ValueError(f"rollout_is must be one of {list(IS_LEVELS)}, got {level!r}")


def _token_statistic(ratio_log: torch.Tensor, statistic: str) -> torch.Tensor:
    if statistic == "k1":
        return ratio_log
    if statistic == "k2":
        return 0.5 * ratio_log**2
    return torch.exp(ratio_log.clamp(max=MAX_LOG_RATIO)) - 1.0 - ratio_log


def _aggregate(values: torch.Tensor, mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """``[batch, response_len]`` statistic per token (``token``) or per row broadcast to its tokens."""
    if aggregation == "token":
        return values
    if aggregation == "seq_sum":
        per_row = masked_sum(values, mask, dim=-1)
    elif aggregation == "seq_mean":
        per_row = masked_mean(values, mask, dim=-1)
    else:
        per_row = values.masked_fill(mask == 0, float("-inf")).max(dim=-1).values.clamp(min=0.0)
    return per_row.unsqueeze(-1).expand_as(values)


def keep_mask(
    ratio_log: torch.Tensor, mask: torch.Tensor, rejection: tuple[RejectionBound, ...]
) -> torch.Tensor:
    """``[batch, response_len]`` 0/1 (dtype of ``ratio_log``): 1 where every option keeps the token.

    All ones without options. Padding positions may hold either value; callers multiply by ``mask``.
    """
    keep = torch.ones_like(ratio_log, dtype=torch.bool)
    for bound in rejection:
        aggregation, _, statistic = bound.option.rpartition("_")
        value = _aggregate(_token_statistic(ratio_log, statistic), mask, aggregation)
        if statistic == "k1":
            lowest = math.log(bound.lower) if bound.lower > 0 else -math.inf
            keep &= (value >= lowest) & (value <= math.log(bound.upper))
        else:
            keep &= value <= bound.upper
    return keep.to(ratio_log.dtype)


@dataclass(frozen=True)
class Correction:
    """The correction of one batch: IS weights and the mask the loss keeps."""

    weights: torch.Tensor | None
    """``[batch, response_len]`` detached IS weights; ``None`` without ``rollout_is``."""

    mask: torch.Tensor
    """``[batch, response_len]`` 0/1: the response mask times the rejection keep mask."""


def apply_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    spec: RolloutCorrectionSpec,
) -> Correction:
    """IS weights and the kept mask of ``[batch, response_len]`` tensors (``mask`` 0/1)."""
    ratio_log = log_ratio(old_logprobs, rollout_logprobs)
    weights = None
    if spec.rollout_is is not None:
        weights = is_weights(ratio_log, mask, level=spec.rollout_is, threshold=spec.rollout_is_threshold)
    kept = mask
    if spec.rejection:  # decided in float64, as correction_stats counts it for the denominators
        kept = mask * keep_mask(ratio_log.double(), mask.double(), spec.rejection).to(mask.dtype)
    return Correction(weights=weights, mask=kept)


_SUMS = (
    "num_tokens",
    "num_seqs",
    "kept_tokens",
    "kept_seqs",
    "seqs_with_rejected",
    "k1",
    "k3",
    "ratio_sq",
    "weight",
    "weight_sq",
    "truncated",
)
_MAXIMA = ("weight_max", "neg_weight_min")


@dataclass(frozen=True)
class CorrectionStats:
    """Additive diagnostics of a batch; merge parts with :meth:`merge` (or SUM/MAX all-reduces)."""

    sums: torch.Tensor
    """``[len(_SUMS)]`` float64 sums over valid tokens / rows, in the order of ``_SUMS``."""

    maxima: torch.Tensor
    """``[len(_MAXIMA)]`` float64: the largest weight and minus the smallest (-inf when empty)."""

    @property
    def kept_tokens(self) -> int:
        """Valid tokens the rejection kept (the loss's token denominator)."""
        return int(self.sums[_SUMS.index("kept_tokens")])

    @property
    def kept_seqs(self) -> int:
        """Rows with at least one kept token (the loss's sequence denominator)."""
        return int(self.sums[_SUMS.index("kept_seqs")])

    def merge(self, other: CorrectionStats) -> CorrectionStats:
        return CorrectionStats(self.sums + other.sums, torch.maximum(self.maxima, other.maxima))

    def metrics(self, spec: RolloutCorrectionSpec) -> dict[str, float]:
        """verl's ``rollout_corr/*`` names, over the valid tokens (rows) of the merged batch.

        ``kl`` = mean ``log μ - log π_old`` (k1 estimate of KL(μ ‖ π_old) on μ's samples),
        ``k3_kl`` = mean ``r - 1 - ℓ``, ``chi2_token`` = mean ``r²`` - 1; ``rollout_is_*`` describe the
        applied weights ``w`` (the untruncated token ratios ``r`` when ``rollout_is`` is null):
        ``mean``, ``max``, ``min``, ``eff_sample_size`` = ``(Σw)² / (N Σw²)``, and with
        ``rollout_is`` ``ratio_fraction_high`` (tokens whose weight was truncated);
        ``rollout_rs_masked_fraction`` (tokens) and ``rollout_rs_seq_masked_fraction`` (rows with
        a rejected token).
        """
        s = dict(zip(_SUMS, self.sums.tolist()))
        weight_max, neg_weight_min = self.maxima.tolist()
        n, seqs = max(s["num_tokens"], 1.0), max(s["num_seqs"], 1.0)
        out = {
            "kl": -s["k1"] / n,
            "k3_kl": s["k3"] / n,
            "chi2_token": s["ratio_sq"] / n - 1.0,
            "rollout_is_mean": s["weight"] / n,
            "rollout_is_max": weight_max if s["num_tokens"] else 0.0,
            "rollout_is_min": -neg_weight_min if s["num_tokens"] else 0.0,
            "rollout_is_eff_sample_size": s["weight"] ** 2 / (n * s["weight_sq"]) if s["weight_sq"] else 1.0,
            "rollout_rs_masked_fraction": 1.0 - s["kept_tokens"] / n if s["num_tokens"] else 0.0,
            "rollout_rs_seq_masked_fraction": s["seqs_with_rejected"] / seqs,
        }
        if spec.rollout_is is not None:
            out["rollout_is_ratio_fraction_high"] = s["truncated"] / n
        return {METRIC_PREFIX + key: value for key, value in out.items()}


def correction_stats(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    spec: RolloutCorrectionSpec,
) -> CorrectionStats:
    """Diagnostics of ``[batch, response_len]`` tensors under ``mask`` (0/1), in float64."""
    ratio_log = log_ratio(old_logprobs, rollout_logprobs).double()
    valid = mask.double()
    ratio = torch.exp(ratio_log.clamp(max=MAX_LOG_RATIO))
    if spec.rollout_is is None:
        weights, truncated = ratio, torch.zeros_like(ratio)
    else:
        weights = is_weights(ratio_log, valid, level=spec.rollout_is, threshold=spec.rollout_is_threshold)
        raw = is_weights(ratio_log, valid, level=spec.rollout_is, threshold=math.inf)
        truncated = (raw > spec.rollout_is_threshold).double()
    kept = valid * keep_mask(ratio_log, valid, spec.rejection)
    has_tokens = valid.sum(-1) > 0
    sums = torch.stack(
        [
            valid.sum(),
            has_tokens.double().sum(),
            kept.sum(),
            (kept.sum(-1) > 0).double().sum(),
            ((valid - kept).sum(-1) > 0).double().sum(),
            masked_sum(ratio_log, valid),
            masked_sum(ratio - 1.0 - ratio_log, valid),
            masked_sum(ratio**2, valid),
            masked_sum(weights, valid),
            masked_sum(weights**2, valid),
            masked_sum(truncated, valid),
        ]
    )
    bool_valid = valid.bool()
    if bool_valid.any():
        maxima = torch.stack([weights[bool_valid].max(), (-weights[bool_valid]).max()])
    else:
        maxima = torch.full((len(_MAXIMA),), -math.inf, dtype=torch.float64, device=weights.device)
    return CorrectionStats(sums=sums, maxima=maxima)
