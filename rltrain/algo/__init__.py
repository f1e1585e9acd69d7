"""Pure tensor math of the RL algorithms: advantages, KL, losses, and the registries that name them.

Importing this package registers every variant (the policy losses of ``policy_losses`` and
``trust_region_losses`` included), whichever of its modules a caller names.

Nothing here imports Megatron, Ray or vLLM, and nothing runs a collective: callers pass global
denominators (``LossAgg``) so results do not depend on how a batch was split.
"""

from rltrain.algo.advantages import (
    ADV_ESTIMATORS,
    AdvantageInputs,
    AdvantageOutput,
    AdvantageParams,
    compute_advantages,
    estimator_needs,
    register_adv_estimator,
)
from rltrain.algo.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    KLInRewardMetrics,
    apply_kl_in_reward,
    build_kl_controller,
    kl_penalty,
)
from rltrain.algo.loss_agg import AGG_MODES, LossAgg, agg_loss
from rltrain.algo.losses import (
    POLICY_LOSSES,
    PolicyLossInputs,
    PolicyLossOutput,
    PolicyLossParams,
    ValueLossOutput,
    compute_entropy_loss,
    compute_kl_loss,
    compute_policy_loss,
    compute_value_loss,
)
from rltrain.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rltrain.algo.policy_losses import (  # registers gspo, cispo, geo_mean, clip_cov, kl_cov, gpg, reinforce
    cispo_policy_loss,
    clip_cov_policy_loss,
    geo_mean_policy_loss,
    gspo_policy_loss,
    kl_cov_policy_loss,
    policy_gradient_loss,
)
from rltrain.algo.registry import Registry, UnknownNameError
from rltrain.algo.trust_region_losses import (  # registers sapo, dro, dppo_tv, dppo_kl
    dppo_kl_policy_loss,
    dppo_tv_policy_loss,
    dro_policy_loss,
    sapo_policy_loss,
)

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageInputs",
    "AdvantageOutput",
    "AdvantageParams",
    "FixedKLController",
    "KLController",
    "KLInRewardMetrics",
    "LossAgg",
    "PolicyLossInputs",
    "PolicyLossOutput",
    "PolicyLossParams",
    "Registry",
    "UnknownNameError",
    "ValueLossOutput",
    "agg_loss",
    "apply_kl_in_reward",
    "build_kl_controller",
    "cispo_policy_loss",
    "clip_cov_policy_loss",
    "compute_advantages",
    "compute_entropy_loss",
    "compute_kl_loss",
    "compute_policy_loss",
    "compute_value_loss",
    "dppo_kl_policy_loss",
    "dppo_tv_policy_loss",
    "dro_policy_loss",
    "estimator_needs",
    "geo_mean_policy_loss",
    "gspo_policy_loss",
    "kl_cov_policy_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_gradient_loss",
    "register_adv_estimator",
    "sapo_policy_loss",
]
