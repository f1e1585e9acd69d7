"""A test model converter, ``LowRankAdapters`` (an additive low-rank delta ``B @ A`` on the
column-parallel linears, ``B`` zero at first, the base weights frozen: LoRA's shape without its
scaling), and the one-rank case that checks the converter seam (``rltrain.megatron.converters``)
against plain references: a model built without the converter that holds the same base weights, and
merges computed here by hand."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from megatron_fixtures import SEED, ensure_process_group, make_batch, optim, policy_loss, tiny_llama

from megatron_bridge.live import bridge_for_chunks, mapped_tensors
from megatron_bridge.reshard import EngineLayout
from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.converters import ModelConverter
from rltrain.megatron.micro_batches import MicroBatching
from rltrain.megatron.parallel import ParallelContext
from rltrain.megatron.worker import MegatronWorker
from rltrain.weight_sync import PlannedExport

ADAPTER = ".low_rank."
"""What every adapter parameter's name holds."""


class LowRankDelta(torch.nn.Module):
    """``x -> x @ A.T @ B.T``: A [rank, in] random, B [out, rank] zero."""

    def __init__(self, in_features: int, out_features: int, *, rank: int, like: torch.Tensor, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        a = 0.1 * torch.randn(rank, in_features, generator=gen, dtype=like.dtype)
        self.a = torch.nn.Parameter(a.to(like.device))
        self.b = torch.nn.Parameter(torch.zeros(out_features, rank, dtype=like.dtype, device=like.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.a.t()) @ self.b.t()


def _add_delta(module: torch.nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
    """Forward hook of an adapted Megatron linear: its output plus the delta of its input."""
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + module.low_rank(x), bias


class LowRankAdapters(ModelConverter):
    """An adapter on every ``linear_qkv`` and ``linear_fc1`` (one TP rank: their input is whole)."""

    name = "low_rank_adapters"

    def __init__(self, *, rank: int = 4, checkpoint_base: bool = True) -> None:
        self.rank = rank
        self.checkpoint_base = checkpoint_base
        """False: the model checkpoint holds the adapters only."""

    @staticmethod
    def targets(chunk: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        names = ("linear_qkv", "linear_fc1")
        return [(n, m) for n, m in chunk.named_modules() if n.rsplit(".", 1)[-1] in names]

    def convert(self, chunk: torch.nn.Module) -> None:
        for i, (_, module) in enumerate(self.targets(chunk)):
            out_features, in_features = module.weight.shape
            module.low_rank = LowRankDelta(
                in_features, out_features, rank=self.rank, like=module.weight, seed=100 + i
            )
            module.register_forward_hook(_add_delta, with_kwargs=True)

    def owned_parameters(self, chunk: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return ((n, p) for n, p in chunk.named_parameters() if ADAPTER in n)

    def trainable(self, name: str) -> bool | None:
        return ADAPTER in name

    def in_checkpoint(self, key: str) -> bool:
        return self.checkpoint_base or ADAPTER in key

    def export(self, chunk: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        merged = dict(tensors)
        for name, module in self.targets(chunk):
            merged[f"{name}.weight"] = tensors[f"{name}.weight"] + module.low_rank.b @ module.low_rank.a
        return merged


def _params(worker: MegatronWorker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.chunks[0].named_parameters()}


def _copy_into(worker: MegatronWorker, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in worker.chunks[0].named_parameters():
            param.copy_(values[name])


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names: list[str]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in names)


def _export(worker: MegatronWorker, hf: Any, ctx: ParallelContext) -> list[tuple[str, torch.Tensor]]:
    bridge = bridge_for_chunks(hf, worker.chunks, ctx)
    planned = PlannedExport(worker.chunks, ctx, bridge, converters=worker.converters)
    return [(n, t.clone()) for n, t in planned.stream(EngineLayout(tp=1), 0, dst=0)]


def _optimizer_params(worker: MegatronWorker) -> list[torch.Tensor]:
    """The model parameters Megatron's (distributed) optimizer updates."""
    found = []
    for sub in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer]):
        for groups in (sub.model_float16_groups, sub.model_fp32_groups):
            found += [p for group in groups for p in group]
    return found


def converter_case(root: str) -> dict[str, Any]:
    """One rank, TP=1: the adapted actor against a plain actor holding the same base weights."""
    hf = tiny_llama(num_hidden_layers=2)
    batch = make_batch(batch_size=4, seed=5)
    batching = MicroBatching(micro_batch_size=2)
    ensure_process_group()
    ctx = ParallelContext.initialize(ParallelConfig(), seed=SEED)
    out: dict[str, Any] = {}
    try:
        adapted = MegatronWorker(
            hf, ctx=ctx, role="actor", batching=batching, optim=optim(), total_steps=4,
            converters=[LowRankAdapters()],
        )  # fmt: skip
        plain = MegatronWorker(hf, ctx=ctx, role="actor", batching=batching)
        names = list(_params(adapted))
        adapters = [n for n in names if ADAPTER in n]
        base = [n for n in names if ADAPTER not in n]
        out["num_adapter_params"] = len(adapters)
        out["mapped_equal_plain"] = [n for n, _ in mapped_tensors(adapted.chunks[0])] == list(_params(plain))
        _copy_into(plain, {n: t for n, t in _params(adapted).items() if n in base})
        out["init_logprob_diff"] = float(
            (adapted.compute_log_prob(batch).logprobs - plain.compute_log_prob(batch).logprobs).abs().max()
        )
        chunk = adapted.chunks[0]
        owned = {id(p) for n, p in chunk.named_parameters() if ADAPTER in n}
        in_optimizer = [id(p) for p in _optimizer_params(adapted)]
        out["optimizer_is_adapters"] = sorted(in_optimizer) == sorted(owned)
        out["ddp_is_adapters"] = sorted(id(p) for b in adapted.model[0].buffers for p in b.params) == sorted(
            owned
        )
        before = _params(adapted)
        step = adapted.update(batch, policy_loss(float(batch.response_mask.sum())))
        after = _params(adapted)
        out["lr"], out["weight_decay"] = step.lr, optim().weight_decay
        out["base_max_change"] = _max_diff(before, after, base)
        out["b_max_abs"] = max(float(after[n].abs().max()) for n in adapters if n.endswith(".b"))
        # B was zero, so A's gradient was zero: AdamW only decayed it, A ← A·(1 − lr·wd).
        decay = 1 - step.lr * optim().weight_decay
        out["a_decay_error"] = max(
            float((after[n] - before[n] * decay).abs().max()) for n in adapters if n.endswith(".a")
        )
        out["a_max_change"] = _max_diff(before, after, [n for n in adapters if n.endswith(".a")])
        # The adapted forward equals the plain model holding the hand-merged weights W + B @ A.
        merged = dict(after)
        for name, _ in LowRankAdapters.targets(chunk):
            merged[f"{name}.weight"] = (
                after[f"{name}.weight"] + after[f"{name}.low_rank.b"] @ after[f"{name}.low_rank.a"]
            )
        base_export = _export(plain, hf, ctx)
        _copy_into(plain, {n: merged[n] for n in base})
        out["merged_logprob_diff"] = float(
            (adapted.compute_log_prob(batch).logprobs - plain.compute_log_prob(batch).logprobs).abs().max()
        )
        ours, reference = _export(adapted, hf, ctx), _export(plain, hf, ctx)
        out["export_names_equal"] = (
            [n for n, _ in ours] == [n for n, _ in reference] == [n for n, _ in base_export]
        )
        out["export_max_diff"] = max(float((a - b).abs().max()) for (_, a), (_, b) in zip(ours, reference))
        out["export_num_merged"] = sum(not torch.equal(a, b) for (_, a), (_, b) in zip(ours, base_export))
        out["export_num_tensors"] = len(ours)
        out.update(_checkpoint_round_trips(hf, ctx, adapted, batching, Path(root)))
    finally:
        ctx.destroy()
    return out


def _checkpoint_round_trips(
    hf: Any, ctx: ParallelContext, trained: MegatronWorker, batching: MicroBatching, root: Path
) -> dict[str, Any]:
    """Save the trained adapted actor; load into fresh ones (a full checkpoint, then adapters only)."""
    from torch.distributed.checkpoint import FileSystemReader

    out: dict[str, Any] = {}
    saved = _params(trained)
    names = list(saved)
    adapters = [n for n in names if ADAPTER in n]
    trained.save_checkpoint(root / "full", step=1)
    fresh = MegatronWorker(
        hf, ctx=ctx, role="actor", batching=batching, optim=optim(), converters=[LowRankAdapters()]
    )
    out["fresh_adapter_diff_before_load"] = _max_diff(saved, _params(fresh), adapters)
    out["full_loaded_step"] = fresh.load_checkpoint(root / "full")
    out["full_round_trip_diff"] = _max_diff(saved, _params(fresh), names)
    # Adapters only: the checkpoint holds no base weight, and a load leaves the base as it was.
    only = MegatronWorker(
        hf, ctx=ctx, role="actor", batching=batching, converters=[LowRankAdapters(checkpoint_base=False)]
    )
    _copy_into(only, saved)
    only.save_checkpoint(root / "adapters", step=0)
    keys = FileSystemReader(str(root / "adapters" / "step_0")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if not k.startswith("rng_state")]
    out["adapters_ckpt_num_keys"] = len(model_keys)
    out["adapters_ckpt_non_adapter_keys"] = [k for k in model_keys if ADAPTER not in k]
    target = MegatronWorker(
        hf, ctx=ctx, role="actor", batching=batching, converters=[LowRankAdapters(checkpoint_base=False)]
    )
    own_base = _params(target)
    target.load_checkpoint(root / "adapters")
    loaded = _params(target)
    out["adapters_round_trip_diff"] = _max_diff(saved, loaded, adapters)
    out["adapters_base_change"] = _max_diff(own_base, loaded, [n for n in names if ADAPTER not in n])
    out["adapters_base_differs_from_saved"] = _max_diff(
        saved, own_base, [n for n in names if ADAPTER not in n]
    )
    return out
