"""The learned reward model (``reward.reward_model``, verl's ``reward_model`` names where it has them).

A Megatron-Core model with a scalar head, loaded from an HF sequence-classification checkpoint
(``*ForSequenceClassification`` with ``num_labels: 1``), scores each response at its last token on
workers of its own (``cluster.role_pool.reward_model`` says on which devices). A sample's reward is
``score_weight × model score + rule_weight × rule score`` (the rule score being what the rule,
custom or remote reward gives); with the defaults the model's score alone, as in verl, where the
reward model's score replaces the rule reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rltrain.config.fields import PositiveInt
from rltrain.config.parallel import ParallelConfig


@dataclass
class RewardModelPathConfig:
    path: str | None = None
    """HF directory of the reward model (a ``*ForSequenceClassification`` checkpoint, one label)."""


@dataclass
class RewardModelConfig:
    enable: bool = False
    """Score responses with a learned reward model."""

    model: RewardModelPathConfig = field(default_factory=RewardModelPathConfig)
    """Where its weights are (``reward.reward_model.model.path``)."""

    micro_batch_size_per_gpu: PositiveInt = 4
    """Samples per forward pass on one rank."""

    use_dynamic_bsz: bool = False
    """Fill micro-batches up to ``forward_max_token_len_per_gpu`` tokens instead."""

    forward_max_token_len_per_gpu: PositiveInt = 32768
    """Token budget of one micro-batch with ``use_dynamic_bsz``."""

    max_length: PositiveInt | None = None
    """Longest sequence (prompt + response) the model accepts; null: any. The run is refused when
    ``data.max_prompt_length + rollout.response_length`` exceeds it (nothing is cut silently)."""

    score_weight: float = 1.0
    """Weight of the model's score in a sample's reward."""

    rule_weight: float = 0.0
    """Weight of the rule (or custom, or remote) reward beside it; 0: the model's score alone."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron parallel layout of the reward model (it must fit its resource pool)."""

    def validate(self, prefix: str) -> list[str]:
        if not self.enable:
            return []
        problems = []
        if not self.model.path:
            problems.append(
                f"{prefix}.enable=true needs {prefix}.model.path (an HF sequence-classification dir)"
            )
        if self.score_weight == 0.0:
            problems.append(f"{prefix}.score_weight=0 ignores the model it enables")
        return problems
