"""One optimizer step of Megatron model chunks with a generic loss callable.

Contract: ``wrap_for_training`` puts the chunks in Megatron's DDP (grads reduced in fp32 over DP×CP:
under context parallelism each CP rank holds the gradient of its own tokens' share),
``build_optimizer`` makes Megatron's (distributed) Adam with decoupled weight decay and an
``OptimizerParamScheduler`` (linear warm-up, then constant/linear/cosine decay to ``min_lr``),
and ``train_step`` runs forward-backward over all micro-batches, computes the global gradient norm,
and either skips the update (non-finite norm, reported as ``skipped=True``) or clips and steps.
Then it looks at the parameters themselves (a finite gradient times a huge learning rate wrecks
them without a non-finite gradient): the largest magnitude over all ranks is reported
(``param_max_abs``), and a parameter that is not finite raises
:class:`~rltrain.errors.DivergenceError` on every rank, naming it, before anything reads it.
Because the loss callable uses global denominators, the gradient equals the full-batch gradient for
any micro-batch split, any data-parallel and any context-parallel size.
Two fixed costs are taken out where they are pure overhead: the buffer collectives over a
data-parallel group of one rank (the identity, see ``skip_single_rank_buffer_collectives``), and
torch's per-tensor AdamW loop where Megatron falls back to torch's AdamW (``fuse_torch_adam``).
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import megatron.core.distributed.param_and_grad_buffer as megatron_buffer_module
import megatron.core.optimizer.optimizer as megatron_optimizer_module
import torch
import torch.distributed as dist
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from rltrain.algo.token_batch import LossFn, TokenBatch
from rltrain.config.optim import OptimConfig
from rltrain.errors import DivergenceError
from rltrain.megatron.forward import run_model
from rltrain.megatron.head_outputs import FusedHead
from rltrain.megatron.micro_batches import MicroBatching
from rltrain.megatron.moe_metrics import RouterStats
from rltrain.megatron.parallel import ParallelContext
from rltrain.tensor_checks import first_non_finite, global_max_abs

logger = logging.getLogger(__name__)


@dataclass
class TrainStepResult:
    """What one optimizer step did; identical on every rank."""

    metrics: dict[str, float]
    """Loss-callable metrics (with ``loss``), summed over micro-batches and DP ranks."""
    grad_norm: float
    """Global L2 norm of the gradient before clipping (may be inf/nan when skipped)."""
    skipped: bool
    """True when the gradient norm was not finite and the parameters were left unchanged."""
    lr: float
    """Learning rate used for this step."""
    param_max_abs: float
    """Largest parameter magnitude after the step, over all ranks (always finite: a non-finite
    parameter raises instead)."""
    moe_metrics: dict[str, float] = field(default_factory=dict)
    """``moe/...`` router statistics of the step's update passes (:mod:`rltrain.megatron.moe_metrics`);
    empty for a dense model."""


def _finalize_without_token_scaling(model: list, num_tokens: torch.Tensor | None = None, **kwargs) -> None:
    # Our losses carry global denominators: never rescale gradients by a token count.
    finalize_model_grads(model, None, **kwargs)


def _identity_on_one_rank(collective: Any) -> Any:
    """``collective(output, input, ...)`` that returns at once where it is the identity: a group of
    one rank, ``output`` and ``input`` the same memory, a synchronous call."""

    def call(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if (
            not kwargs.get("async_op", False)
            and dist.get_world_size(kwargs.get("group")) == 1
            and output.data_ptr() == input.data_ptr()
            and output.numel() == input.numel()
            and output.dtype == input.dtype
        ):
            return None
        return collective(output, input, *args, **kwargs)

    call.identity_on_one_rank = True  # type: ignore[attr-defined]
    call.wrapped = collective  # type: ignore[attr-defined]
    return call


def skip_single_rank_buffer_collectives() -> None:
    """Megatron's DDP reduce-scatters the gradient buffer and its distributed optimizer all-gathers
    the parameter buffer over the data-parallel group even where that group is one rank, where the
    rank's shard is the whole buffer and both are the identity. Gloo still copies it: 0.6 s of each
    7 s optimizer update of SmolLM2-135M at DP=1. This makes those two calls return at once in that
    case (any backend; idempotent); with more than one rank they run as before."""
    for name in ("dist_reduce_scatter_func", "dist_all_gather_func"):
        current = getattr(megatron_buffer_module, name)
        if not getattr(current, "identity_on_one_rank", False):
            setattr(megatron_buffer_module, name, _identity_on_one_rank(current))


def wrap_for_training(
    chunks: list[torch.nn.Module], *, use_distributed_optimizer: bool
) -> list[DistributedDataParallel]:
    """Wrap model chunks in Megatron's DDP and register the grad-finalize hook on their config."""
    skip_single_rank_buffer_collectives()
    config = chunks[0].config
    config.finalize_model_grads_func = _finalize_without_token_scaling
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


def fuse_torch_adam(optimizer: MegatronOptimizer) -> None:
    """Switch the torch AdamW that Megatron falls back to (no Transformer Engine or Apex: every CPU
    run) from torch's per-tensor loop, its default off CUDA, to torch's fused kernel: the same AdamW
    update, which rounds differently on at most an ulp of a few elements per thousand (0.2% of them,
    at most 2.4e-7 apart after three steps, in a test of this machine). On SmolLM2-135M's
    parameters one step took 0.28 s in the loop and 0.055 s fused. A checkpoint's saved
    hyperparameters (``fused`` among them) win on load."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW) or inner.state:
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if any(p.device.type not in ("cpu", "cuda") or not p.dtype.is_floating_point for p in params):
            continue
        if any(group.get("differentiable") or group.get("capturable") for group in inner.param_groups):
            continue
        for group in [inner.defaults, *inner.param_groups]:
            group["fused"], group["foreach"] = True, False


def build_optimizer(
    chunks: list[DistributedDataParallel],
    optim: OptimConfig,
    *,
    total_steps: int,
    offload_optimizer: bool = False,
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """Megatron Adam over ``chunks`` plus its LR/WD scheduler for ``total_steps`` optimizer steps.

    ``offload_optimizer`` keeps optimizer state and the update on the CPU (Megatron's hybrid
    optimizer, GPU only); on a CPU-only machine everything already lives on the CPU and it is ignored.
    """
    model_config = chunks[0].config
    offload = offload_optimizer and torch.cuda.is_available()
    if offload_optimizer and not offload:
        logger.info("offload_optimizer ignored: no CUDA device, optimizer state already on the CPU")
    config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=optim.clip_grad,
        bf16=model_config.bf16,
        fp16=model_config.fp16,
        params_dtype=model_config.params_dtype,
        use_distributed_optimizer=optim.use_distributed_optimizer,
        optimizer_cpu_offload=offload,
        optimizer_offload_fraction=1.0 if offload else 0.0,
    )
    optimizer = get_megatron_optimizer(config, chunks)
    count_expert_grads_over_expert_tp(optimizer)
    fuse_torch_adam(optimizer)
    warmup = optim.lr_warmup_steps or int(optim.lr_warmup_steps_ratio * total_steps)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(total_steps, warmup + 1),
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def count_expert_grads_over_expert_tp(optimizer: MegatronOptimizer) -> None:
    """Give the experts' optimizer the expert tensor-parallel group as its ``tp_group``.

    Megatron-Core 0.16.1 gives every optimizer of the chain the attention TP group, and the gradient
    norm counts a parameter not marked ``tensor_model_parallel`` on that group's rank 0 only (its
    copies on the other ranks being duplicates). An expert's unsplit parameter (a biased expert's
    ``linear_fc2`` bias) is duplicated over the expert TP group instead: at TP=2 over EP=2 (expert
    TP 1) the two ranks of a TP group hold different experts, and the norm left out rank 1's
    (gpt-oss: 14.4055 against the single rank's 14.4083)."""
    from megatron.core import parallel_state

    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if any(group.get("is_expert_parallel") for group in sub.optimizer.param_groups):
            sub.tp_group = parallel_state.get_expert_tensor_parallel_group()


def train_step(
    chunks: list[DistributedDataParallel],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    batch: TokenBatch,
    *,
    ctx: ParallelContext,
    batching: MicroBatching,
    loss_fn: LossFn,
    critic: bool = False,
    vocab_size: int | None = None,
    fused: FusedHead | None = None,
    router_stats: RouterStats | None = None,
    router_replay: bool = False,
) -> TrainStepResult:
    """Forward-backward over ``batch``, then one (possibly skipped) optimizer step (``fused``: the
    actor's log-probs by the fused LM head, :func:`~rltrain.megatron.forward.run_model`;
    ``router_replay``: the MoE routers replay ``batch.routed_experts``).

    With experts, Megatron's grad finalization (end of the forward-backward) also moves the
    aux-loss-free expert bias by the step's loads, as Megatron's own training loop does, also when
    the update is then skipped; ``router_stats`` reports the step's router statistics."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    with router_stats.recording() if router_stats else nullcontext():
        result = run_model(
            chunks,
            batch,
            ctx=ctx,
            batching=batching,
            outputs="values" if critic else "logprobs",
            loss_fn=loss_fn,
            vocab_size=vocab_size,
            fused=None if critic else fused,
            router_replay="replay" if router_replay else None,
        )
    moe_metrics = router_stats.metrics(ctx) if router_stats else {}
    lr = optimizer.param_groups[0]["lr"]
    grad_norm, skipped = _step(optimizer)
    if skipped:
        logger.warning("skipping optimizer step: gradient norm is %s", grad_norm)
    else:
        scheduler.step(increment=1)
    role = "critic" if critic else "actor"
    param_max_abs = _check_parameters(chunks, role=role, device=ctx.device, grad_norm=grad_norm, lr=lr)
    return TrainStepResult(
        metrics=result.metrics,
        grad_norm=grad_norm,
        skipped=skipped,
        lr=lr,
        param_max_abs=param_max_abs,
        moe_metrics=moe_metrics,
    )


def _check_parameters(
    chunks: list[DistributedDataParallel], *, role: str, device: torch.device, grad_norm: float, lr: float
) -> float:
    """The largest parameter magnitude over every rank (collective: every rank of the role runs each
    train step); raises :class:`DivergenceError` on every rank, naming the first parameter that is
    not finite (in rank order, then model order), when there is one."""
    named = [(name, p) for chunk in chunks for name, p in getattr(chunk, "module", chunk).named_parameters()]
    largest = global_max_abs(named, device=device)
    if math.isfinite(largest):
        return largest
    found = first_non_finite(named)
    assert found is not None, "global_max_abs saw a non-finite value that no rank holds"
    rank, name = found
    raise DivergenceError(
        f"{role} diverged: parameter {name} (rank {rank}) is not finite after an optimizer step "
        f"(gradient norm {grad_norm:.4g}, lr {lr:g}); stopped before it reaches the engines or a checkpoint"
    )


@torch.no_grad()
def _step(optimizer: MegatronOptimizer) -> tuple[float, bool]:
    """Megatron's ``step()`` with a finiteness check between the norm and the update."""
    found_inf = optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    if found_inf or not math.isfinite(grad_norm):
        optimizer.zero_grad()
        return grad_norm, True
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = sub.get_parameters()
        if sub.config.clip_grad > 0.0 and params:
            # Looked up at call time so that the CPU replacement of this function applies.
            megatron_optimizer_module.clip_grad_by_total_norm_fp32(
                params, max_norm=sub.config.clip_grad, total_norm=grad_norm
            )
    optimizer.step_with_ready_grads()
    return grad_norm, False
