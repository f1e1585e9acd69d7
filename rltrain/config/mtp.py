"""Training of a checkpoint's multi-token-prediction (MTP) layers (DeepSeek-V3's and GLM-4.5's
``num_nextn_predict_layers``), in verl's names (``actor_rollout_ref.model.mtp``).

The actor always builds, loads, checkpoints and exports the MTP layers a checkpoint has (verl's
``enable``, which rltrain does not need: nothing is dropped). By default training ignores them: they
stay frozen and are exported unchanged. ``enable_train`` adds their loss to the actor's.
"""

from __future__ import annotations

from dataclasses import dataclass

from rltrain.config.fields import NonNegativeFloat


@dataclass
class MTPConfig:
    enable_train: bool = False
    """Train the MTP layers: they become trainable, and the actor's loss adds
    ``mtp_loss_scaling_factor`` × the mean over MTP layers of their cross-entropy on the response
    tokens (layer k predicts token t + k + 2 from position t), aggregated like the policy loss
    (``actor.loss_agg_mode``, the mini-batch's global denominators) and logged as
    ``actor/mtp_loss``; its gradient reaches the whole model unless ``detach_encoder``.
    false: the layers are frozen, ignored by the loss and exported unchanged. Needs a model with MTP
    layers and ``actor.parallel.context_parallel_size: 1``."""

    mtp_loss_scaling_factor: NonNegativeFloat = 0.1
    """Weight of the MTP loss in the actor's loss (Megatron-Core's ``mtp_loss_scaling_factor``; verl's
    default 0.1); used with ``enable_train`` only."""

    detach_encoder: bool = False
    """With ``enable_train``: the MTP loss's gradient stops at the MTP layers' inputs (the main
    model's final hidden states and the token embeddings), so that it trains the MTP layers and the
    output layer they share, not the rest of the model (verl's ``detach_encoder``, which verl
    recommends). false: it reaches the whole model."""

    def validate(self, prefix: str, *, context_parallel_size: int) -> list[str]:
        """``context_parallel_size``: the actor's (``actor.parallel``)."""
        if self.detach_encoder and not self.enable_train:
            return [
                f"{prefix}.detach_encoder needs {prefix}.enable_train: true (nothing trains the MTP layers)"
            ]
        if self.enable_train and context_parallel_size > 1:
            return [
                f"{prefix}.enable_train with actor.parallel.context_parallel_size={context_parallel_size}: "
                "the MTP loss is computed at context_parallel_size 1 only"
            ]
        return []
