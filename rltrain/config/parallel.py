"""Model-parallel layout of one Megatron role (actor, critic or reference).

The data-parallel size is not configured: it is derived from the devices the role is given
(``world_size // (tensor * pipeline * context)``), so a recipe cannot state two contradicting numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from rltrain.config.fields import PositiveInt, field_problems


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: PositiveInt = 1
    """Tensor-parallel (TP) size: attention heads and MLP columns are split over this many ranks."""

    pipeline_model_parallel_size: PositiveInt = 1
    """Pipeline-parallel (PP) size: the layers are split into this many consecutive stages."""

    virtual_pipeline_model_parallel_size: PositiveInt | None = None
    """Interleaved-schedule model chunks per pipeline stage (VPP); null disables interleaving."""

    num_layers_in_first_pipeline_stage: PositiveInt | None = None
    """Decoder layers on the first pipeline stage (Megatron-Core's uneven PP); null: an even share.
    The layers the first/last stage counts leave are split evenly over the other stages."""

    num_layers_in_last_pipeline_stage: PositiveInt | None = None
    """Decoder layers on the last pipeline stage (uneven PP, e.g. 61-layer DeepSeek-V3); null: an even share."""

    context_parallel_size: PositiveInt = 1
    """Context-parallel (CP) size: each sequence is split over this many ranks (padded to a multiple
    of 2·CP and cut into 2·CP chunks; rank r holds chunks r and 2·CP−1−r, which balances causal
    attention). Needs packed sequences (``use_remove_padding``) and a dense (not MoE) model; a dynamic
    micro-batch's ``ppo_max_token_len_per_gpu`` counts the tokens one CP rank holds."""

    expert_model_parallel_size: PositiveInt = 1
    """Expert-parallel (EP) size for MoE models: the experts are divided over this many ranks."""

    expert_tensor_parallel_size: PositiveInt | None = None
    """Tensor-parallel size inside each expert; null means the same as ``tensor_model_parallel_size``."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism (shards LayerNorm/dropout activations over TP); needs TP > 1."""

    def model_parallel_size(self) -> int:
        """Ranks that hold one full copy of the model: TP × PP × CP."""
        return (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel size for ``world_size`` ranks; the caller validates divisibility first."""
        return world_size // self.model_parallel_size()

    def validate(self, prefix: str, world_size: int | None = None) -> list[str]:
        """Return the problems of this layout, each naming its key under ``prefix``."""
        problems = field_problems(self, prefix)
        if problems:
            return problems  # sizes below 1 would divide by zero below
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and self.pipeline_model_parallel_size < 2:
            problems.append(
                f"{prefix}.virtual_pipeline_model_parallel_size={vpp} needs "
                f"{prefix}.pipeline_model_parallel_size >= 2 (got {self.pipeline_model_parallel_size})"
            )
        for key in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            count = getattr(self, key)
            if count is None:
                continue
            if self.pipeline_model_parallel_size < 2:
                problems.append(
                    f"{prefix}.{key}={count} needs {prefix}.pipeline_model_parallel_size >= 2 "
                    f"(got {self.pipeline_model_parallel_size})"
                )
            elif vpp is not None and count % vpp:
                problems.append(
                    f"{prefix}.{key}={count} is not a multiple of "
                    f"{prefix}.virtual_pipeline_model_parallel_size={vpp}"
                )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            problems.append(f"{prefix}.sequence_parallel=true needs {prefix}.tensor_model_parallel_size > 1")
        etp = self.expert_tensor_parallel_size or self.tensor_model_parallel_size
        if self.expert_model_parallel_size * etp < self.tensor_model_parallel_size:
            # Measured at TP=2, EP=1, expert-TP=1 on a tiny Qwen3-MoE: the forward equals one rank's,
            # the experts' gradients do not (the next step's loss off by 0.18); at EP=2 it is exact.
            problems.append(
                f"{prefix}: expert_model_parallel_size × expert_tensor_parallel_size = "
                f"{self.expert_model_parallel_size}×{etp} is below tensor_model_parallel_size="
                f"{self.tensor_model_parallel_size}: experts repeated over the attention tensor-parallel "
                "ranks train with wrong gradients in Megatron-Core 0.16; raise expert_model_parallel_size "
                "or expert_tensor_parallel_size"
            )
        if world_size is not None and not problems:
            mp = self.model_parallel_size()
            if world_size % mp:
                problems.append(
                    f"{prefix}: TP×PP×CP = {self.tensor_model_parallel_size}×"
                    f"{self.pipeline_model_parallel_size}×{self.context_parallel_size} = {mp} "
                    f"does not divide the {world_size} devices given to the role"
                )
            else:
                dp = world_size // mp
                # Megatron lays experts over (EP × expert-TP) ranks carved out of DP × CP × TP.
                expert_span = self.expert_model_parallel_size * etp
                dense_span = dp * self.context_parallel_size * self.tensor_model_parallel_size
                if dense_span % expert_span:
                    problems.append(
                        f"{prefix}: expert_model_parallel_size × expert_tensor_parallel_size = "
                        f"{self.expert_model_parallel_size}×{etp} does not divide DP×CP×TP = {dense_span}"
                    )
        return problems
