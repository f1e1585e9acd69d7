"""Context parallelism (CP=2, alone and with TP=2+SP, PP=2, dynamic batch size) against CP=1.

Run on four gloo ranks. The CP=1 reference (DP=4) saves its initial weights and the CP layouts load
them (a pipeline stage cannot reproduce the reference's random initialization by itself); the CP=2
actor saves them again, and CP=2×PP=2 loads that copy, so saving and loading under CP are both in
the comparison.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron_fixtures import (
    SEED,
    dp_shard,
    ensure_process_group,
    make_batch,
    max_diffs,
    optim,
    policy_loss,
    tiny_llama,
    value_loss,
)

import rltrain.megatron.packed_attention as packed_attention
from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.micro_batches import MicroBatching
from rltrain.megatron.parallel import ParallelContext
from rltrain.megatron.worker import MegatronWorker


def cp_optim():
    """The shared test optimizer with Adam's eps at 1e-3: its first step moves each parameter by
    lr·g/(|g| + eps), so with eps = 1e-6 a gradient entry near zero turns its rounding noise into a
    full ±lr step and the parameter comparison would compare noise; with 1e-3 it follows the gradient."""
    return dataclasses.replace(optim(), eps=1e-3)


def cp_batch():
    """Four ragged rows (left-padded prompts, right-padded responses): lengths 20, 13, 18, 19."""
    return make_batch(batch_size=4, seq=20, response_len=10, seed=1)


def _round(
    role: str, hf: Any, parallel: ParallelConfig, batching: MicroBatching, *, load_from=None, save_to=None
):
    """Build ``role`` at ``parallel``, forward, train step, (parameters), forward, train step."""
    ensure_process_group()
    ctx = ParallelContext.initialize(parallel, seed=SEED)
    try:
        worker = MegatronWorker(hf, ctx=ctx, role=role, batching=batching, optim=cp_optim(), total_steps=4)
        if load_from:
            worker.load_checkpoint(load_from, load_optimizer=False)
        if save_to:
            worker.save_checkpoint(save_to, step=0)
        batch = cp_batch()
        tokens = float(batch.response_mask.sum())  # the global count: whole sequences, every DP rank
        if role == "actor":
            forward, loss = (lambda: worker.compute_log_prob(batch)), policy_loss(tokens)
        else:
            forward, loss = (lambda: worker.compute_values(batch)), value_loss(tokens)
        before = forward()
        first = worker.update(dp_shard(batch, ctx), loss)
        params = None
        if ctx.tp_size == ctx.pp_size == 1:
            params = torch.cat([p.detach().flatten() for p in worker.chunks[0].parameters()])
        after = forward()
        second = worker.update(dp_shard(batch, ctx), loss)
        out = {
            "loss": torch.tensor([first.metrics["loss"], second.metrics["loss"]]),
            "grad_norm": torch.tensor([first.grad_norm, second.grad_norm]),
        }
        if role == "actor":
            out.update(logprobs=before.logprobs, entropy=before.entropy, logprobs_after=after.logprobs)
        else:
            out.update(values=before, values_after=after)
        return out, params
    finally:
        ctx.destroy()


def _scores(hf: Any, parallel: ParallelConfig, batching: MicroBatching, load_from: str) -> torch.Tensor:
    ensure_process_group()
    ctx = ParallelContext.initialize(parallel, seed=SEED)
    try:
        worker = MegatronWorker(hf, ctx=ctx, role="reward", batching=batching)
        worker.load_checkpoint(load_from, load_optimizer=False)
        return worker.compute_rm_scores(cp_batch())
    finally:
        ctx.destroy()


def cp_case(tmp: str) -> dict[str, dict[str, float]]:
    hf = tiny_llama()
    one = MicroBatching(micro_batch_size=1, use_remove_padding=True)
    two = MicroBatching(micro_batch_size=2, use_remove_padding=True)
    # 6 tokens per CP rank: at most one (padded) sequence per micro-batch → two per DP rank.
    dynamic = MicroBatching(use_dynamic_bsz=True, max_token_len=10, use_remove_padding=True)
    cp2 = ParallelConfig(context_parallel_size=2)
    default_min_chunk = packed_attention.MERGED_MIN_CHUNK
    diffs: dict[str, dict[str, float]] = {}

    ref, ref_params = _round("actor", hf, ParallelConfig(), one, save_to=f"{tmp}/actor")
    got, params = _round("actor", hf, cp2, two, load_from=f"{tmp}/actor", save_to=f"{tmp}/actor_cp2")
    diffs["actor_cp2"] = {**max_diffs(ref, got), "params": float((params - ref_params).abs().max())}
    got, _ = _round("actor", hf, cp2, dynamic, load_from=f"{tmp}/actor")
    diffs["actor_cp2_dynamic"] = max_diffs(ref, got)
    cp2_tp2 = ParallelConfig(context_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)
    # The test's sequences are short (chunks of 2–5 tokens): at CP×TP, run every segment through
    # the mask-free attention that long ones take; the other layouts take the masked one.
    packed_attention.MERGED_MIN_CHUNK = 1
    got, _ = _round("actor", hf, cp2_tp2, two, load_from=f"{tmp}/actor")
    packed_attention.MERGED_MIN_CHUNK = default_min_chunk
    diffs["actor_cp2_tp2_sp"] = max_diffs(ref, got)
    cp2_pp2 = ParallelConfig(context_parallel_size=2, pipeline_model_parallel_size=2)
    got, _ = _round("actor", hf, cp2_pp2, one, load_from=f"{tmp}/actor_cp2")
    diffs["actor_cp2_pp2"] = max_diffs(ref, got)

    ref, ref_params = _round("critic", hf, ParallelConfig(), one, save_to=f"{tmp}/critic")
    got, params = _round("critic", hf, cp2, two, load_from=f"{tmp}/critic")
    diffs["critic_cp2"] = {**max_diffs(ref, got), "params": float((params - ref_params).abs().max())}
    packed_attention.MERGED_MIN_CHUNK = 1
    got, _ = _round("critic", hf, cp2_tp2, dynamic, load_from=f"{tmp}/critic")
    packed_attention.MERGED_MIN_CHUNK = default_min_chunk
    diffs["critic_cp2_tp2_dynamic"] = max_diffs(ref, got)

    ref_scores = _scores(hf, ParallelConfig(), two, f"{tmp}/critic")
    cp_scores = _scores(hf, cp2, two, f"{tmp}/critic")
    diffs["reward_cp2"] = {"scores": float((ref_scores - cp_scores).abs().max())}
    diffs["sanity"] = {
        "num_micro_dynamic": float(len(dynamic.split(dp_shard(cp_batch(), _Half()), cp_size=2))),
        "values_changed": float((ref["values"] - ref["values_after"]).abs().max()),
        "params_norm": float(ref_params.norm()),
    }
    return diffs


class _Half:
    """The DP=2 shard of ``cp_batch`` that rank 0 of a CP=2 layout gets."""

    dp_rank, dp_size = 0, 2
