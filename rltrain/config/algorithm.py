"""Advantage estimation, KL regularization and rollout correction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from rltrain.config.fields import NonNegativeFloat, PositiveFloat, PositiveInt

if TYPE_CHECKING:
    from rltrain.algo.rollout_correction import RolloutCorrectionSpec

KLEstimator = Literal[
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
    "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+",
]  # fmt: skip
"""rltrain/algo/kl.py: k1/k2/k3 are verl's names of kl/mse/low_var_kl; ``+``: value of the estimator,
gradient of k2 (straight-through)."""


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    """``fixed`` keeps β; ``adaptive`` moves β toward ``target_kl`` (Ziegler et al. 2019)."""

    kl_coef: NonNegativeFloat = 0.001
    """β, the initial KL coefficient in the reward."""

    target_kl: float = 0.1
    """KL per sequence the adaptive controller aims for."""

    horizon: PositiveInt = 10000
    """Samples over which the adaptive controller corrects a KL error (larger = slower)."""


@dataclass
class RolloutCorrectionConfig:
    """verl's ``algorithm.rollout_correction``: correct for the gap between the engine's behaviour
    log-probs and the trainer's (rltrain/algo/rollout_correction.py has the formulas). Setting the
    section (even ``{}``) logs the ``rollout_corr/*`` diagnostics every step."""

    rollout_is: Literal["token", "sequence"] | None = None
    """Importance weights π_old/π_rollout on the actor loss: per token, per sequence (product of
    the token ratios), or null (none, diagnostics only)."""

    rollout_is_threshold: PositiveFloat = 2.0
    """Upper truncation of the IS weights."""

    rollout_rs: str | None = None
    """Rejection (masked IS, IcePop-style): comma-separated options ``token_k1``, ``seq_sum_k1``,
    ``seq_mean_k1`` (geometric mean), ``{token,seq_sum,seq_mean,seq_max}_{k2,k3}``; rejected tokens or
    sequences leave the actor loss and its denominators. Null: none."""

    rollout_rs_threshold: str | float | int | None = None
    """Bounds of ``rollout_rs``, one for all options or one per option (comma-separated): ``k1``
    options take ``"lower_upper"`` ratio bounds (one number ``u`` means ``1/u_u``); ``k2``/``k3`` one
    upper bound. Quote it in YAML: YAML reads ``0.5_2`` as the number 0.52."""

    def spec(self) -> RolloutCorrectionSpec:
        """The pure-math description (raises ValueError on bad thresholds; ``validate`` reports them)."""
        from rltrain.algo.rollout_correction import RolloutCorrectionSpec, parse_rejection  # torch, lazily

        return RolloutCorrectionSpec(
            rollout_is=self.rollout_is,
            rollout_is_threshold=self.rollout_is_threshold,
            rejection=parse_rejection(self.rollout_rs, self.rollout_rs_threshold),
        )

    def validate(self, prefix: str) -> list[str]:
        from rltrain.algo.rollout_correction import parse_rejection  # torch, lazily

        try:
            parse_rejection(self.rollout_rs, self.rollout_rs_threshold)
        except ValueError as err:  # each message starts with the key it is about
            return [f"{prefix}.{err}"]
        return []


def tis_alias_problems(
    tis_imp_ratio_cap: float | None, correction: RolloutCorrectionConfig | None
) -> list[str]:
    """``actor.tis_imp_ratio_cap`` is the older name of ``rollout_is=token`` with
    ``rollout_is_threshold=cap``; both may be set only when they agree."""
    if tis_imp_ratio_cap is None or correction is None or correction.rollout_is is None:
        return []
    if correction.rollout_is == "token" and correction.rollout_is_threshold == tis_imp_ratio_cap:
        return []
    return [
        f"actor.tis_imp_ratio_cap={tis_imp_ratio_cap} disagrees with algorithm.rollout_correction.rollout_is="
        f"{correction.rollout_is}, rollout_is_threshold={correction.rollout_is_threshold}: set only the latter "
        "(tis_imp_ratio_cap is rollout_is=token with rollout_is_threshold=cap)"
    ]


@dataclass
class FilterGroupsConfig:
    """verl's ``algorithm.filter_groups``: DAPO's dynamic sampling. A group (the ``rollout.n``
    samples of one prompt) whose ``metric`` is the same for every sample has zero advantage under
    the group estimators and teaches nothing; such groups are dropped, and more prompts are
    generated (``data.gen_batch_size`` a round) until ``data.train_batch_size`` groups are kept
    (rltrain/trainer/dynamic_sampling.py). Needs ``trainer.pipeline=sync``."""

    enable: bool = False
    """Drop the groups whose ``metric`` does not vary and generate more until the batch is full."""

    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] | None = None
    """What must vary within a group: ``acc`` (answer correct), ``score`` (the reward), ``seq_reward``
    (the reward plus an interaction's turn rewards), ``seq_final_reward`` (the same, the KL in the
    reward is not known yet at filtering time: refused with ``use_kl_in_reward``). Required with
    ``enable``."""

    max_num_gen_batches: int = 0
    """Generation rounds (the first included) a step may use before it gives up with an error naming
    this key; 0 or less: no bound (verl)."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    """A registered advantage estimator (``rltrain.algo.register_adv_estimator``; formulas in
    rltrain/algo/advantages.py and advantages_group.py): ``gae``, ``grpo``, ``rloo``,
    ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``remax``, ``opo``, ``gpg``,
    ``grpo_passk``. Only ``gae`` reads values (a critic); ``grpo``, ``rloo``,
    ``reinforce_plus_plus_baseline``, ``opo``, ``gpg`` and ``grpo_passk`` compare the ``rollout.n``
    samples of a prompt (n >= 2); ``remax`` subtracts the reward of a greedy response the rollout
    generates for each prompt."""

    gamma: float = 1.0
    """Discount factor."""

    lam: float = 1.0
    """GAE λ."""

    norm_adv_by_std_in_grpo: bool = True
    """GRPO divides by the group's std; false gives the mean-only variant of Dr. GRPO."""

    use_kl_in_reward: bool = False
    """Subtract β·KL(π‖π_ref) per token from the reward."""

    kl_penalty: KLEstimator = "kl"
    """KL estimator for the in-reward penalty."""

    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Controller of β for the in-reward penalty."""

    rollout_correction: RolloutCorrectionConfig | None = None
    """Rollout correction (IS weights, rejection, ``rollout_corr/*`` diagnostics); null: off."""

    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling (off by default)."""

    def estimator_needs(self) -> frozenset[str] | None:
        """The optional inputs ``adv_estimator`` declared when it was registered (``values``,
        ``group_ids``, ``reward_baselines``); None for a name that is not registered (``validate``
        names it)."""
        from rltrain.algo import ADV_ESTIMATORS  # torch, lazily

        name = self.adv_estimator
        return ADV_ESTIMATORS.get(name).needs if name in ADV_ESTIMATORS else None

    def validate(self, prefix: str) -> list[str]:
        from rltrain.algo import ADV_ESTIMATORS  # torch, lazily

        problems = ADV_ESTIMATORS.problems(self.adv_estimator, f"{prefix}.adv_estimator")
        if not 0 <= self.gamma <= 1:
            problems.append(f"{prefix}.gamma must lie in [0, 1], got {self.gamma}")
        if not 0 <= self.lam <= 1:
            problems.append(f"{prefix}.lam must lie in [0, 1], got {self.lam}")
        if self.kl_ctrl.type == "adaptive":
            if self.kl_ctrl.target_kl <= 0:
                problems.append(f"{prefix}.kl_ctrl.target_kl must be > 0, got {self.kl_ctrl.target_kl}")
            if not self.use_kl_in_reward:
                problems.append(
                    f"{prefix}.kl_ctrl.type=adaptive has no effect without {prefix}.use_kl_in_reward=true"
                )
        if self.rollout_correction is not None:
            problems += self.rollout_correction.validate(f"{prefix}.rollout_correction")
        return problems
