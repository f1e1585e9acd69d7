"""Run on every rank by test_megatron_fused_head: one actor's log-probs, entropy, loss and gradients
with the fused chunked LM head (``model.use_fused_kernels``) against the logits path on the same
weights, for several layouts."""

from __future__ import annotations

import torch
from megatron_cases import train_step_no_update
from megatron_fixtures import SEED, dp_shard, ensure_process_group, make_batch, optim, policy_loss, tiny_llama

from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.head_outputs import FusedHead
from rltrain.megatron.micro_batches import MicroBatching
from rltrain.megatron.model import gpt_model
from rltrain.megatron.parallel import ParallelContext
from rltrain.megatron.worker import MegatronWorker

LAYOUTS = {
    "dp2": (ParallelConfig(), {}),
    "tp2_tied": (ParallelConfig(tensor_model_parallel_size=2), {"tie_word_embeddings": True}),
    "tp2_sp": (ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), {}),
    "pp2": (ParallelConfig(pipeline_model_parallel_size=2), {}),
}


def _grads(worker: MegatronWorker) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.detach().clone() for n, p in worker.named_parameters()}


def fused_head_case() -> dict[str, float]:
    ensure_process_group()
    out: dict[str, float] = {}
    batch = make_batch(batch_size=6, seed=9)
    tokens = float(batch.response_mask.sum())
    for name, (parallel, overrides) in LAYOUTS.items():
        hf = tiny_llama(num_hidden_layers=2, **overrides)
        ctx = ParallelContext.initialize(parallel, seed=SEED)
        try:
            worker = MegatronWorker(
                hf,
                ctx=ctx,
                role="actor",
                optim=optim(),
                total_steps=2,
                batching=MicroBatching(micro_batch_size=2, use_remove_padding=True),
            )
            for group in worker.optimizer.param_groups:
                group["lr"] = 0.0  # gradients only: both variants see the same weights
            local = dp_shard(batch, ctx)
            results = {}
            for variant, fused in (("logits", None), ("fused", FusedHead(chunk_size=5))):
                worker.fused = fused
                lp = worker.compute_log_prob(local)
                loss, grad_norm = train_step_no_update(worker, local, policy_loss(tokens))
                results[variant] = (lp.logprobs, lp.entropy, loss, grad_norm, _grads(worker))
            ref, got = results["logits"], results["fused"]
            out[f"{name}_logprobs"] = float((ref[0] - got[0]).abs().max())
            out[f"{name}_entropy"] = float((ref[1] - got[1]).abs().max())
            out[f"{name}_loss"] = abs(ref[2] - got[2])
            out[f"{name}_grad_norm"] = abs(ref[3] - got[3])
            out[f"{name}_grads"] = max(float((ref[4][k] - got[4][k]).abs().max()) for k in ref[4])
            out[f"{name}_grad_norm_value"] = ref[3]
            heads = [
                h for m in worker.model if (h := getattr(gpt_model(m), "output_layer", None)) is not None
            ]
            out[f"{name}_head_restored"] = float(
                all(type(h).__name__ == "ColumnParallelLinear" for h in heads)
            )
        finally:
            ctx.destroy()
    return out
