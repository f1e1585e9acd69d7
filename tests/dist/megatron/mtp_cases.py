"""Rank function of the MTP loss tests: the actor of a tiny DeepSeek-V3 (the released config,
shrunk; one MTP layer) in the default mode (MTP ignored) and with ``model.mtp.enable_train``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from megatron_fixtures import SEED, ensure_process_group, make_batch, optim

from rltrain.algo.loss_agg import GlobalCounts
from rltrain.algo.loss_specs import ActorLoss
from rltrain.algo.losses import PolicyLossParams
from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.head_outputs import FusedHead
from rltrain.megatron.micro_batches import MicroBatching
from rltrain.megatron.parallel import ParallelContext
from rltrain.megatron.worker import MegatronWorker
from rltrain.workers.ppo_losses import actor_loss_fn

MODES = {
    "ignore": (None, False),
    "train": (0.5, False),
    "train_factor_0": (0.0, False),
    "train_detached": (0.5, True),
}
"""Each actor of the case: its ``mtp_loss_scaling_factor`` (None: the default, MTP ignored) and
``detach_encoder``."""


def mtp_checkpoint(tmp: str) -> str:
    """The released DeepSeek-V3 config shrunk, weights of std 0.15 (peaked next-token
    distributions), random expert biases, and its MTP layer (which transformers does not write)."""
    from rltrain.models.tiny import add_mtp_layers, randomize_expert_bias
    from tests.released import save_released_model

    src = save_released_model(f"{tmp}/deepseek-v3", "deepseek-v3", seed=2, initializer_range=0.15)
    randomize_expert_bias(src, scale=0.5)
    add_mtp_layers(src, std=0.15)
    return str(src)


def _mtp_params(worker: MegatronWorker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.chunks[0].named_parameters() if n.startswith("mtp.")}


def _main_params(worker: MegatronWorker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.chunks[0].named_parameters() if not n.startswith("mtp.")}


def _worker(
    hf: Any,
    ctx: ParallelContext,
    batching: MicroBatching,
    *,
    train_mtp: bool,
    fused: FusedHead | None = None,
    detach: bool = False,
) -> MegatronWorker:
    return MegatronWorker(
        hf,
        detach_mtp_inputs=detach,
        fused=fused,
        ctx=ctx,
        role="actor",
        batching=batching,
        # no clipping: the clip factor divides by the gradient norm, whose sum the optimizer
        # groups differently when it also holds the MTP parameters (a rounding difference)
        optim=replace(optim(), clip_grad=0.0),
        total_steps=2,
        train_mtp=train_mtp,
    )


def _restored_mtp(hf: Any, root: str, batching: MicroBatching, *, train_mtp: bool) -> dict[str, torch.Tensor]:
    """The MTP parameters of an actor (MTP trained or not) that loaded the checkpoint in ``root``."""
    ctx = ParallelContext.initialize(ParallelConfig(), seed=SEED + 1)
    try:
        worker = _worker(hf, ctx, batching, train_mtp=train_mtp)
        assert worker.load_checkpoint(root, load_optimizer=False) == 1
        return _mtp_params(worker)
    finally:
        ctx.destroy()


def _refusal_without_mtp_layers(batching: MicroBatching) -> str:
    """The error of an actor asked to train MTP layers on a model that has none (a tiny llama)."""
    from megatron_fixtures import tiny_llama

    ctx = ParallelContext.initialize(ParallelConfig(), seed=SEED)
    try:
        _worker(tiny_llama(), ctx, batching, train_mtp=True)
    except ValueError as err:
        return str(err)
    finally:
        ctx.destroy()
    return "no error"


def _one_step(
    src: str, hf: Any, factor: float | None, batching: MicroBatching, *, save_to: str, detach: bool
) -> dict[str, Any]:
    from megatron_bridge.hf_io import HFCheckpointReader
    from megatron_bridge.live import bridge_for_chunks, export_hf_weights, load_hf_weights

    ctx = ParallelContext.initialize(ParallelConfig(), seed=SEED)
    try:
        worker = _worker(hf, ctx, batching, train_mtp=factor is not None, detach=detach)
        bridge = bridge_for_chunks(hf, worker.chunks, ctx)
        load_hf_weights(worker.chunks, ctx, bridge, HFCheckpointReader(src))
        batch = make_batch(seed=5)
        batch = replace(batch, old_logprobs=worker.compute_log_prob(batch).logprobs)
        mtp_before, main_before = _mtp_params(worker), _main_params(worker)
        spec = ActorLoss(
            loss_mode="vanilla",
            params=PolicyLossParams(),
            loss_agg_mode="token-mean",
            loss_scale_factor=None,
            mtp_loss_scaling_factor=factor,
        )
        result = worker.update(batch, actor_loss_fn(spec, GlobalCounts.of(batch.response_mask)))
        grads_seen = {
            n: p.main_grad.abs().max().item() if getattr(p, "main_grad", None) is not None else None
            for n, p in worker.chunks[0].named_parameters()
            if n.startswith("mtp.")
        }
        main_grads = {
            n: p.main_grad.detach().clone()
            for n, p in worker.chunks[0].named_parameters()
            if not n.startswith("mtp.") and p.requires_grad
        }
        mtp_after, main_after = _mtp_params(worker), _main_params(worker)
        exported = dict(export_hf_weights(worker.chunks, ctx, bridge))
        worker.save_checkpoint(save_to, step=1)
        return {
            "metrics": result.metrics,
            "grad_norm": result.grad_norm,
            "logprobs_after": worker.compute_log_prob(batch).logprobs,
            "mtp_trainable": [
                p.requires_grad for n, p in worker.chunks[0].named_parameters() if n.startswith("mtp.")
            ],
            "mtp_grad_max": max(v for v in grads_seen.values() if v is not None)
            if any(grads_seen.values())
            else 0.0,
            "mtp_changed": max((mtp_after[n] - mtp_before[n]).abs().max().item() for n in mtp_before),
            "mtp_unchanged_bitwise": all(torch.equal(mtp_after[n], mtp_before[n]) for n in mtp_before),
            "main_after": main_after,
            "mtp_after": mtp_after,
            "main_grads": main_grads,
            "main_changed": max((main_after[n] - main_before[n]).abs().max().item() for n in main_before),
            "exported": exported,
            "batch": batch,
        }
    finally:
        ctx.destroy()


def hf_mtp_cross_entropy(src: str, batch: Any, *, shift: int = 0) -> float:
    """The MTP loss from transformers' MTP logits (``hf_mtp_logits``) of each row's real tokens: the
    cross-entropy of each response token from the position 2 tokens before it, summed, over the
    response-token count (token-mean; one MTP layer). ``shift`` moves the predictor (a wrong
    alignment, to see that the comparison can fail)."""
    from megatron_bridge.verify import hf_mtp_logits

    total, count = 0.0, 0
    seq, response_len = batch.input_ids.shape[1], batch.response_len
    for row in range(batch.batch_size):
        real = batch.attention_mask[row].bool()
        ids = batch.input_ids[row][real]
        (logits,) = hf_mtp_logits(src, ids[None])  # [1, len - 1, vocab]: position i predicts i + 2
        log_p = torch.log_softmax(logits[0].double(), -1)
        first = int((~real).long().cumprod(0).sum())  # left padding of the row
        for j in range(response_len):
            column = seq - response_len + j
            if not batch.response_mask[row, j]:
                continue
            count += 1
            position = column - first  # index of the token among the row's real tokens
            predictor = position - 2 + shift
            if predictor >= 0:
                total -= float(log_p[predictor, ids[position]])
    return total / count


def mtp_loss_case(tmp: str) -> dict[str, Any]:
    """One actor step per mode on the same checkpoint and batch (packed rows, two micro-batches);
    numbers to assert."""
    from megatron_bridge.hf_config import load_hf_config
    from megatron_bridge.hf_io import HFCheckpointReader

    ensure_process_group()
    src = mtp_checkpoint(tmp)
    hf = load_hf_config(src)
    batching = MicroBatching(micro_batch_size=2, use_remove_padding=True)
    runs = {
        mode: _one_step(src, hf, factor, batching, save_to=f"{tmp}/checkpoint_{mode}", detach=detach)
        for mode, (factor, detach) in MODES.items()
    }
    refusal = _refusal_without_mtp_layers(batching)
    # a checkpoint holds the MTP layers in either mode, and loads into either
    trained_into_frozen = _restored_mtp(hf, f"{tmp}/checkpoint_train", batching, train_mtp=False)
    frozen_into_trained = _restored_mtp(hf, f"{tmp}/checkpoint_ignore", batching, train_mtp=True)
    reader = HFCheckpointReader(src)
    mtp_names = [n for n in reader.names() if n.startswith(f"model.layers.{hf.num_hidden_layers}.")]
    ignore, train, zero = runs["ignore"], runs["train"], runs["train_factor_0"]
    batch = train["batch"]
    return {
        "refusal_without_mtp_layers": refusal,
        "checkpoint": src,
        "reference_mtp_loss": hf_mtp_cross_entropy(src, batch),
        "misaligned_reference_mtp_loss": hf_mtp_cross_entropy(src, batch, shift=1),
        "metrics": {mode: run["metrics"] for mode, run in runs.items()},
        "grad_norm": {mode: run["grad_norm"] for mode, run in runs.items()},
        "mtp_trainable": {mode: run["mtp_trainable"] for mode, run in runs.items()},
        "mtp_grad_max": {mode: run["mtp_grad_max"] for mode, run in runs.items()},
        "mtp_changed": {mode: run["mtp_changed"] for mode, run in runs.items()},
        "mtp_unchanged_bitwise": ignore["mtp_unchanged_bitwise"],
        "num_mtp_tensors": len(mtp_names),
        "checkpoint_train_into_frozen_equal": all(
            torch.equal(trained_into_frozen[n], runs["train"]["mtp_after"][n]) for n in trained_into_frozen
        ),
        "checkpoint_frozen_into_trained_equal": all(
            torch.equal(frozen_into_trained[n], runs["ignore"]["mtp_after"][n]) for n in frozen_into_trained
        ),
        "num_mtp_params": len(trained_into_frozen),
        "ignore_exports_mtp_changed": [
            n for n in mtp_names if not torch.equal(ignore["exported"][n], reader.get(n))
        ],
        "ignore_exported_copies_follow_main": all(
            torch.equal(
                ignore["exported"][f"model.layers.{hf.num_hidden_layers}.{copy}"], ignore["exported"][main]
            )
            for copy, main in (
                ("embed_tokens.weight", "model.embed_tokens.weight"),
                ("shared_head.head.weight", "lm_head.weight"),
            )
        ),
        "train_exports_mtp_changed": sum(
            not torch.equal(train["exported"][n], reader.get(n)) for n in mtp_names
        ),
        "factor_0_main_grads_equal": all(
            torch.equal(zero["main_grads"][n], ignore["main_grads"][n]) for n in ignore["main_grads"]
        ),
        "factor_0_logprobs_after_equal": torch.equal(zero["logprobs_after"], ignore["logprobs_after"]),
        "factor_0_main_params_equal": all(
            torch.equal(zero["main_after"][n], ignore["main_after"][n]) for n in ignore["main_after"]
        ),
        "detached_main_grads_changed": sorted(
            n
            for n in ignore["main_grads"]
            if not torch.equal(runs["train_detached"]["main_grads"][n], ignore["main_grads"][n])
        ),
        "train_main_differs": max(
            (train["main_after"][n] - ignore["main_after"][n]).abs().max().item()
            for n in ignore["main_after"]
        ),
    }


LAYOUTS = {
    "pp2_packed": (ParallelConfig(pipeline_model_parallel_size=2), True, None),
    "tp2_sp_padded": (ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), False, None),
    "tp2_sp_fused_head": (
        ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
        True,
        FusedHead(chunk_size=7),
    ),
}
"""Two-rank layouts of the MTP loss: the MTP layer on the last of two stages (packed rows), the
vocabulary split over TP with sequence parallelism (padded rows), and the fused log-prob head
(hidden states in place of the MTP layer's logits; packed rows). Megatron-Core trains MoE layers at
TP > 1 only with sequence parallelism."""


def mtp_loss_layouts_case(src: str) -> dict[str, float]:
    """The MTP loss mode's first-step metrics at each of ``LAYOUTS`` (on 2 ranks), from the
    checkpoint ``src`` of :func:`mtp_checkpoint`."""
    from megatron_bridge.hf_config import load_hf_config
    from megatron_bridge.hf_io import HFCheckpointReader
    from megatron_bridge.live import bridge_for_chunks, load_hf_weights

    ensure_process_group()
    hf = load_hf_config(src)
    out = {}
    for name, (parallel, packed, fused) in LAYOUTS.items():
        ctx = ParallelContext.initialize(parallel, seed=SEED)
        try:
            batching = MicroBatching(micro_batch_size=2, use_remove_padding=packed)
            worker = _worker(hf, ctx, batching, train_mtp=True, fused=fused)
            load_hf_weights(
                worker.chunks, ctx, bridge_for_chunks(hf, worker.chunks, ctx), HFCheckpointReader(src)
            )
            batch = make_batch(seed=5)
            batch = replace(batch, old_logprobs=worker.compute_log_prob(batch).logprobs)
            spec = ActorLoss("vanilla", PolicyLossParams(), "token-mean", None, mtp_loss_scaling_factor=0.5)
            result = worker.update(batch, actor_loss_fn(spec, GlobalCounts.of(batch.response_mask)))
            out[name] = result.metrics["actor/mtp_loss"]
        finally:
            ctx.destroy()
    return out
