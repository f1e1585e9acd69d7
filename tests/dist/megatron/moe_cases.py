"""MoE router cases run on every rank: one update of a tiny Qwen3-MoE at EP = world size, with the
routers' inputs captured by the test, for hand computation in the parent process."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from megatron_fixtures import SEED, dp_shard, ensure_process_group, make_batch, optim, policy_loss

from rltrain.config.moe import MoEConfig
from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.micro_batches import MicroBatching
from rltrain.megatron.parallel import ParallelContext
from rltrain.megatron.worker import MegatronWorker

BIAS_UPDATE_RATE = 0.01


def tiny_qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, router_aux_loss_coef=0.01,
        initializer_range=0.15,
    )  # fmt: skip


def moe_options(expert_bias: bool) -> MoEConfig:
    if expert_bias:
        return MoEConfig(
            moe_z_loss_coeff=1e-3,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=BIAS_UPDATE_RATE,
            moe_per_layer_logging=True,
        )
    return MoEConfig(moe_z_loss_coeff=1e-3, moe_per_layer_logging=True)


def _routers(worker: MegatronWorker) -> dict[int, torch.nn.Module]:
    return {r.layer_number: r for r in worker.router_stats.routers}


def _worker(ctx: ParallelContext, expert_bias: bool) -> MegatronWorker:
    batching = MicroBatching(micro_batch_size=1, use_remove_padding=True)
    return MegatronWorker(
        tiny_qwen3_moe(),
        ctx=ctx,
        role="actor",
        batching=batching,
        optim=optim(),
        moe=moe_options(expert_bias),
    )


LAYOUTS = {
    "ep": lambda world: ParallelConfig(expert_model_parallel_size=world),
    "pp": lambda world: ParallelConfig(pipeline_model_parallel_size=world),
    "tp_sp": lambda world: ParallelConfig(tensor_model_parallel_size=world, sequence_parallel=True),
}


def router_update_case(
    tmp: str, expert_bias: bool, layout: str = "ep", full_rows: bool = False
) -> dict[str, Any]:
    """One update at EP (or PP, TP: ``layout``) = world size (world 1 saves its initial weights,
    world 2 loads them); ``full_rows``: every row 16 real tokens (no padding for the layout to add).

    Returns the step's ``moe_metrics``, each training router forward's logits computed here by hand
    from its captured input and weight (per layer, in forward order), and the expert bias before and
    after the step; with ``expert_bias`` also the bias after a finalize on hand-made loads."""
    ensure_process_group()
    world = dist.get_world_size()
    ctx = ParallelContext.initialize(LAYOUTS[layout](world), seed=SEED)
    try:
        worker = _worker(ctx, expert_bias)
        if world == 1:
            worker.save_checkpoint(f"{tmp}/init", step=0)
        else:
            worker.load_checkpoint(f"{tmp}/init", load_optimizer=False)
        routers = _routers(worker)
        logits: dict[int, list[torch.Tensor]] = {n: [] for n in routers}

        def capture(router: torch.nn.Module, args: tuple, output: tuple) -> None:
            if router.training and torch.is_grad_enabled():
                x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
                logits[router.layer_number].append(x @ router.weight.detach().double().T)

        handles = [r.register_forward_hook(capture) for r in routers.values()]
        for r in routers.values():
            if r.expert_bias is not None:
                # A bias that changes the routing: the counts must follow sigmoid + bias.
                r.expert_bias.copy_(torch.tensor([0.4, -0.4, 0.2, 0.0]))
        bias_before = {n: r.expert_bias.clone() for n, r in routers.items() if r.expert_bias is not None}
        batch = make_batch()
        if full_rows:
            batch = dataclasses.replace(batch, attention_mask=torch.ones_like(batch.attention_mask))
        result = worker.update(dp_shard(batch, ctx), policy_loss(float(batch.response_mask.sum())))
        for handle in handles:
            handle.remove()
        out: dict[str, Any] = {
            "metrics": result.moe_metrics,
            "logits": logits,
            "bias_before": bias_before,
            "bias_after": {n: r.expert_bias.clone() for n, r in routers.items() if r.expert_bias is not None},
        }
        if expert_bias:
            out |= _hand_made_loads_and_reload(worker, ctx, tmp)
        return _plain(out)
    finally:
        ctx.destroy()


def _plain(value: Any) -> Any:
    """Tensors as nested lists: tensors sent through the harness's queue outlive their process."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def hand_made_loads(rank: int, layer: int) -> torch.Tensor:
    """Tokens per expert this rank pretends to have routed (ties with the mean included)."""
    table = {1: [[3.0, 0.0, 5.0, 4.0], [1.0, 4.0, 0.0, 3.0]], 2: [[6.0, 2.0, 2.0, 2.0], [0.0, 2.0, 2.0, 0.0]]}
    return torch.tensor(table[layer][rank % 2])


def _hand_made_loads_and_reload(worker: MegatronWorker, ctx: ParallelContext, tmp: str) -> dict[str, Any]:
    """The bias after Megatron's grad finalization (rltrain's hook) on hand-made loads; then the bias
    a fresh worker loads from a checkpoint of it."""
    routers = _routers(worker)
    before = {n: r.expert_bias.clone() for n, r in routers.items()}
    for n, r in routers.items():
        r.local_tokens_per_expert.copy_(hand_made_loads(dist.get_rank(), n))
    worker.chunks[0].config.finalize_model_grads_func(worker.model)
    after = {n: r.expert_bias.clone() for n, r in routers.items()}
    worker.save_checkpoint(f"{tmp}/after", step=1)
    fresh = _worker(ctx, expert_bias=True)
    fresh.load_checkpoint(f"{tmp}/after")
    loaded = {n: r.expert_bias.clone() for n, r in _routers(fresh).items()}
    return {"hand_before": before, "hand_after": after, "loaded": loaded}
