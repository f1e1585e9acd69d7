"""Functions the Megatron GPU tests run in rank processes (``dist_harness.run_ranks``, one rank).

Each returns plain Python values (tensors as nested lists: a tensor put on the result queue travels as a
file descriptor that dies with the rank process). Megatron, transformers and ``rltrain.megatron`` are
imported inside the functions: the test modules import this one on any machine, and the CPU
reference must hide Transformer Engine before Megatron is first imported.

- ``cpu_reference``: the CPU column of DESIGN.md (gloo, local layer spec, fp32) with CUDA hidden by
  the caller (``CUDA_VISIBLE_DEVICES=""``): a seeded tiny Llama actor's weights exported through the
  bridge, moved off the initialization by seeded noise and written as an HF safetensors file, loaded
  back as the trainer loads a checkpoint, then log-probs, one optimizer step (loss, grad norm) and
  log-probs again.
- ``gpu_actor``: the same on CUDA (NCCL) in ``params_dtype``, loading that file.
- ``offload_round_trip``: ``MegatronWorker.offload_to_cpu`` / ``reload_to_device`` on CUDA, with the
  device memory before, between and after, and whether parameters and outputs came back bit-exact.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

BATCHING = dict(micro_batch_size=2, use_remove_padding=True)
"""Packed rows: the GPU path refuses padded ones (``forward.run_model``); two micro-batches."""


WEIGHT_NOISE = 0.05
"""Added to the exported weights (initialized with std 0.15) before they are written."""


def hide_transformer_engine() -> None:
    """Make ``import transformer_engine`` (and apex) fail in this process, before Megatron is imported:
    the CPU reference runs the CPU stack even where Transformer Engine is installed."""
    for name in ("transformer_engine", "apex"):
        sys.modules[name] = None  # type: ignore[assignment]


def layer_spec_in_use() -> str:
    """The layers ``rltrain.megatron.model.layer_spec`` builds on CUDA in this process: Transformer
    Engine's, or where it does not import the local ones (what the CPU runs), with the reason."""
    from rltrain.megatron.cpu_compat import transformer_engine_problem

    problem = transformer_engine_problem()
    return (
        "transformer_engine" if problem is None else f"local (Transformer Engine not importable: {problem})"
    )


def actor_numbers(worker: Any, ctx: Any, hf_config: Any, model_dir: str) -> dict[str, Any]:
    """Load ``model_dir`` into the built ``worker`` the way the trainer does
    (``rltrain.workers.model_workers.load_hf_into``, which imports no Ray), then log-probs, one update
    and log-probs again."""
    from megatron_fixtures import make_batch, policy_loss

    from rltrain.workers.rank_base import load_hf_into

    load_hf_into(worker, ctx=ctx, hf_config=hf_config, model_dir=model_dir)
    batch = make_batch()
    mask = batch.response_mask.bool()
    before = worker.compute_log_prob(batch)
    step = worker.update(batch, policy_loss(float(mask.sum())))
    after = worker.compute_log_prob(batch)
    return {
        "logprobs": before.logprobs.float().cpu().tolist(),
        "entropy": before.entropy.float().cpu().tolist(),
        "logprobs_after": after.logprobs.float().cpu().tolist(),
        "loss": float(step.metrics["loss"]),
        "grad_norm": float(step.grad_norm),
        "skipped": bool(step.skipped),
        "mask": mask.tolist(),
        "advantages": batch.advantages.float().tolist(),
        "param_dtype": str(next(worker.chunks[0].parameters()).dtype),
    }


def cpu_reference(model_dir: str) -> dict[str, Any]:
    """fp32 on the CPU; writes the actor's seeded weights to ``model_dir/model.safetensors`` first."""
    hide_transformer_engine()
    if torch.cuda.is_available():
        raise RuntimeError("the CPU reference sees a CUDA device: start it with CUDA_VISIBLE_DEVICES=''")
    from megatron_fixtures import SEED, ensure_process_group, optim, tiny_llama
    from safetensors.torch import save_file

    from megatron_bridge.live import bridge_for_chunks, export_hf_weights
    from rltrain.config.parallel import ParallelConfig
    from rltrain.megatron.micro_batches import MicroBatching
    from rltrain.megatron.parallel import ParallelContext
    from rltrain.megatron.worker import MegatronWorker

    hf = tiny_llama()
    ensure_process_group()
    ctx = ParallelContext.initialize(ParallelConfig(), seed=SEED)
    try:
        worker = MegatronWorker(
            hf,
            ctx=ctx,
            role="actor",
            batching=MicroBatching(**BATCHING),
            optim=optim(),
            total_steps=4,
            params_dtype=torch.float32,
        )
        bridge = bridge_for_chunks(hf, worker.chunks, ctx)
        # Moved away from the seeded initialization: a model that kept its own initialization
        # somewhere (a stale fp32 copy in the optimizer) must not agree by luck.
        noise = torch.Generator().manual_seed(SEED + 1)
        weights = {
            name: (tensor + WEIGHT_NOISE * torch.randn(tensor.shape, generator=noise)).contiguous()
            for name, tensor in export_hf_weights(worker.chunks, ctx, bridge)
        }
        save_file(weights, f"{model_dir}/model.safetensors")
        return actor_numbers(worker, ctx, hf, model_dir)
    finally:
        ctx.destroy()


def gpu_actor(model_dir: str, dtype_name: str) -> dict[str, Any]:
    """The CPU reference's actor on CUDA in ``params_dtype=torch.<dtype_name>``, loading ``model_dir``."""
    spec = layer_spec_in_use()
    # fp32 must mean fp32 (TF32 GEMMs keep 10 mantissa bits); torch's defaults, made explicit.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from megatron_fixtures import SEED, optim, tiny_llama

    from rltrain.config.parallel import ParallelConfig
    from rltrain.megatron.micro_batches import MicroBatching
    from rltrain.megatron.parallel import ParallelContext
    from rltrain.megatron.worker import MegatronWorker

    hf = tiny_llama()
    ctx = ParallelContext.initialize(ParallelConfig(), seed=SEED)
    try:
        worker = MegatronWorker(
            hf,
            ctx=ctx,
            role="actor",
            batching=MicroBatching(**BATCHING),
            optim=optim(),
            total_steps=4,
            params_dtype=getattr(torch, dtype_name),
        )
        out = actor_numbers(worker, ctx, hf, model_dir)
        out.update(spec=spec, device=f"{ctx.device} {torch.cuda.get_device_name(ctx.device)}")
        return out
    finally:
        ctx.destroy()


def offload_round_trip(role: str, use_distributed_optimizer: bool, offload: bool = True) -> dict[str, Any]:
    """Offload and reload a bf16 ``role`` worker (~18 M parameters) on CUDA; what moved and what came back.
    ``offload=False``: the same steps without the round trip, the reference for the step after it.

    The actor takes one optimizer step first (its gradients and Adam state exist, its parameters
    left their initialization) and one more after the reload. ``expected_bytes`` is counted from the
    parameters themselves: each one's bytes plus, for a trained role, its fp32 gradient
    (``grad_reduce_in_fp32``); the buffers' padding is what the test's slack allows for.
    """
    spec = layer_spec_in_use()
    from megatron_fixtures import SEED, make_batch, policy_loss, tiny_llama

    from rltrain.config.optim import OptimConfig
    from rltrain.config.parallel import ParallelConfig
    from rltrain.megatron.micro_batches import MicroBatching
    from rltrain.megatron.parallel import ParallelContext
    from rltrain.megatron.worker import MegatronWorker

    hf = tiny_llama(
        hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4, vocab_size=8192
    )
    trained = role == "actor"
    optim = OptimConfig(lr=1e-3, use_distributed_optimizer=use_distributed_optimizer) if trained else None
    ctx = ParallelContext.initialize(ParallelConfig(), seed=SEED)
    try:
        worker = MegatronWorker(
            hf, ctx=ctx, role=role, batching=MicroBatching(**BATCHING), optim=optim, total_steps=4
        )
        batch = make_batch()
        loss_fn = policy_loss(float(batch.response_mask.sum()))
        if trained:
            worker.update(batch, loss_fn)
        logprobs = worker.compute_log_prob(batch).logprobs
        params = {name: p.detach().cpu().clone() for name, p in worker.named_parameters()}
        expected = sum(
            p.numel() * (p.element_size() + (4 if trained else 0)) for _, p in worker.named_parameters()
        )
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        if offload:
            worker.offload_to_cpu()
        torch.cuda.synchronize()
        offloaded = torch.cuda.memory_allocated()
        if offload:
            worker.reload_to_device()
        torch.cuda.synchronize()
        reloaded = torch.cuda.memory_allocated()
        back = dict(worker.named_parameters())
        out: dict[str, Any] = {
            "spec": spec,
            "param_dtype": str(next(iter(back.values())).dtype),
            "num_params": sum(p.numel() for p in params.values()),
            "expected_bytes": expected,
            "allocated": allocated,
            "offloaded": offloaded,
            "reloaded": reloaded,
            "params_on_device": all(p.device == ctx.device for p in back.values()),
            "params_bit_exact": [n for n, p in back.items() if not torch.equal(p.detach().cpu(), params[n])]
            == [],
            "logprobs_bit_exact": torch.equal(worker.compute_log_prob(batch).logprobs, logprobs),
        }
        if trained:
            grads = [p.main_grad for p in back.values()]
            out["grads_zero_after_reload"] = all(int(torch.count_nonzero(g)) == 0 for g in grads)
            step = worker.update(batch, loss_fn)
            out["step_after_reload_skipped"] = step.skipped
            out["step_after_reload_grad_norm"] = step.grad_norm
            moved = worker.compute_log_prob(batch).logprobs
            out["step_after_reload_moved_logprobs"] = float((moved - logprobs).abs().max())
            out["logprobs_after_second_step"] = moved.float().cpu().tolist()
        return out
    finally:
        ctx.destroy()
