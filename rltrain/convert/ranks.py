"""The work of one conversion rank: build the layout on the meta device, stream, write, verify.

Contract: ``rank_main(mode, src, dst, hf, tp, pp, ep, verify, atol)`` runs on every rank of a
``tp × pp × ep`` process group started from the launcher environment (``launch.run_conversion``
spawns them) and returns a ``ConversionReport`` as a dict (rank 0's is the one that counts).
Each rank builds the model on the meta device (``model.build_padded_model``): it describes the
layout (shapes, Megatron's checkpoint keys) and holds no weights. Every mode streams one tensor at
a time: HF tensors are read one conversion unit at a time (``megatron_bridge.hf_io``), Megatron
checkpoints region by region (``megatron_bridge.dcp_io``; ``megatron_bridge.mcore_view`` presents
one under HF names), and Megatron checkpoints are written by a writer that produces each stored
chunk right before writing it (``rltrain.megatron.streamed_checkpoint``), in the trainer's
checkpoint layout (``rltrain.megatron.checkpoint``: ``dst/step_0`` + ``dst/latest``, loadable at
any TP/PP/EP) with ``dst/hf/`` (config, tokenizer, generation config) beside it. A rank's peak
memory grows by a few of the largest tensors, whatever the model size (measured on every rank over
the conversion, the maximum reported). Unless ``verify`` is false: (a) every tensor of the result,
read back in the source's terms, must be bit-identical to the source (streamed too); (b) unless
``atol`` is None, the Megatron logits on a probe batch of hundreds of tokens, computed in the
checkpoint's dtype, must match transformers' in that dtype within ``atol`` plus the dtype's
rounding noise for this model (``megatron_bridge.verify.compare_logits``; this forward holds each
rank's shard of the model, as any forward must). Failures raise ``VerificationError`` naming the
tensors, or the logits difference and its tolerance. ``dst`` is where the launcher stages the
output; it publishes it only when every rank succeeded.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_bridge.bridge import Bridge
from megatron_bridge.convert import compare_bit_exact, reshard_source, write_hf
from megatron_bridge.dcp_io import DistCheckpointReader
from megatron_bridge.errors import VerificationError
from megatron_bridge.hf_config import load_hf_config
from megatron_bridge.hf_io import HFCheckpointReader, copy_hf_aux_files
from megatron_bridge.live import LazyShards, bridge_for_chunks, chunk_namings
from megatron_bridge.mcore_view import MegatronCheckpointView
from megatron_bridge.memory import PeakMemory
from megatron_bridge.verify import (
    LogitsComparison,
    compare_logits,
    compare_mtp_logits,
    megatron_logits,
    megatron_logits_and_mtp,
    probe_batch,
    probe_tokens,
    routing_flips_allowed,
)
from rltrain.config.parallel import ParallelConfig
from rltrain.convert.model import build_padded_model
from rltrain.convert.report import MODES, ConversionReport
from rltrain.megatron.checkpoint import checkpoint_keys, find_latest, load_checkpoint, save_checkpoint
from rltrain.megatron.parallel import ParallelContext
from rltrain.megatron.streamed_checkpoint import StreamedSaveStrategy

Chunks = list[torch.nn.Module]


def setup_rank(
    hf_config_dir: Path,
    tp: int,
    pp: int,
    ep: int,
    *,
    meta: bool = False,
    stages: tuple[int | None, int | None] = (None, None),
    etp: int | None = None,
) -> tuple[Any, ParallelContext, Callable[[], Chunks], Chunks, Bridge]:
    """(HF config, context, a builder of the real model, this rank's chunks, their bridge); ``stages``:
    decoder layers on the first and last pipeline stage (None: an even split); ``etp``: expert-TP size
    (None: ``tp``)."""
    config = load_hf_config(hf_config_dir)
    ctx = ParallelContext.initialize(
        ParallelConfig(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            num_layers_in_first_pipeline_stage=stages[0],
            num_layers_in_last_pipeline_stage=stages[1],
        )
    )
    dtype = getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype

    def build() -> Chunks:
        return build_padded_model(config, ctx, dtype=dtype)

    chunks = build_padded_model(config, ctx, dtype=dtype, meta=True) if meta else build()
    return config, ctx, build, chunks, bridge_for_chunks(config, chunks, ctx)


def _check_logits(
    chunks: Chunks, ctx: ParallelContext, bridge: Bridge, hf_dir: Path, atol: float, tokens: int
) -> tuple[LogitsComparison | None, list[LogitsComparison]]:
    """Megatron's logits vs transformers', both in the model's dtype, and from the same forward each
    multi-token-prediction layer's against transformers' ``MtpModel`` (transformers' forward does
    not run those layers, so a wrong MTP mapping the round trip undoes, swapped norms or experts,
    would pass without it), on rank 0 (None and [] elsewhere); raises ``VerificationError`` saying
    which logits differ, by how much, and what that was held to."""
    ids = probe_batch(bridge.dims.vocab_size, seq=tokens)
    vocab = bridge.dims.vocab_size
    if bridge.num_mtp_layers:
        ours, ours_mtp = megatron_logits_and_mtp(chunks, ctx, ids, vocab_size=vocab)
    else:
        ours, ours_mtp = megatron_logits(chunks, ctx, ids, vocab_size=vocab), None
    if ctx.rank != 0:
        return None, []
    dtype = next(chunks[0].parameters()).dtype
    flips = routing_flips_allowed(num_experts=bridge.dims.num_experts, tokens=ids.numel())
    comparison = compare_logits(ours, hf_dir, ids, dtype=dtype, atol=atol, flips_allowed=flips)
    if not comparison.ok:
        raise VerificationError(f"the converted model's {comparison.describe()}")
    mtp = (
        compare_mtp_logits(ours_mtp, hf_dir, ids, dtype=dtype, atol=atol, flips_allowed=flips)
        if ours_mtp
        else []
    )
    for k, layer in enumerate(mtp):
        if not layer.ok:
            raise VerificationError(f"the converted model's MTP layer {k} {layer.describe()}")
    return comparison, mtp


def _locations(
    chunks: Chunks, ctx: ParallelContext, bridge: Bridge
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every canonical parameter's (checkpoint key, index), gathered from all ranks (collective)."""
    mine = {
        naming.to_canonical(local): where
        for naming, keys in zip(chunk_namings(chunks, ctx, bridge), checkpoint_keys(chunks))
        for local, where in keys.items()
    }
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    return {name: where for part in gathered for name, where in part.items()}


def rank_main(
    mode: str,
    src: str,
    dst: str,
    hf: str,
    tp: int,
    pp: int,
    ep: int,
    verify: bool,
    atol: float | None,
    stages: tuple[int | None, int | None] = (None, None),
    etp: int | None = None,
) -> dict:
    if mode not in MODES:
        raise ValueError(
            f"unknown conversion mode {mode!r}; expected hf-to-mcore, mcore-to-hf, mcore-to-mcore"
        )
    src_p, dst_p, hf_dir = Path(src), Path(dst), Path(hf)
    config, ctx, build, chunks, bridge = setup_rank(hf_dir, tp, pp, ep, meta=True, stages=stages, etp=etp)
    locations = _locations(chunks, ctx, bridge)
    src_step = None
    if mode != "hf-to-mcore":
        src_step = find_latest(src_p)
        if src_step is None:
            raise FileNotFoundError(f"{src_p}: no Megatron checkpoint ({src_p / 'latest'} is missing)")
    source = (
        HFCheckpointReader(src_p) if src_step is None else MegatronCheckpointView(src_step, config, locations)
    )
    progress = ctx.rank == 0
    report = ConversionReport(mode, {"tp": tp, "pp": pp, "ep": ep})
    report.num_tensors = len(source.names())
    report.largest_tensor_bytes = max(source.info(n).nbytes for n in source.names())
    report.checkpoint_bytes = source.total_bytes()

    memory = PeakMemory.start()
    if mode == "hf-to-mcore":
        shards = LazyShards(chunks, ctx, bridge, source)
        strategy = StreamedSaveStrategy(
            lambda region, placeholder: shards.materialize(placeholder),
            order=lambda region, placeholder: shards.unit_order(placeholder),
            progress=progress,
        )
        save_checkpoint(dst_p, step=0, ctx=ctx, chunks=chunks, sharded_strategy=strategy)
        shards.close()
    elif mode == "mcore-to-mcore":
        strategy = StreamedSaveStrategy(reshard_source(DistCheckpointReader(src_step)), progress=progress)
        save_checkpoint(dst_p, step=0, ctx=ctx, chunks=chunks, sharded_strategy=strategy)
    elif ctx.rank == 0:
        write_hf(source, dst_p, aux_from=hf_dir, progress=progress)
    dist.barrier()
    report.peak_memory_growth_bytes = _max_over_ranks(ctx, memory.stop().growth_bytes)
    if mode != "mcore-to-hf" and ctx.rank == 0:
        (dst_p / "hf").mkdir(exist_ok=True)
        copy_hf_aux_files(hf_dir, dst_p / "hf")
    dist.barrier()
    if not verify:
        ctx.destroy()
        return report.__dict__

    # (a) bit-exact, one tensor at a time: the result read back in the source's own terms.
    if ctx.rank == 0:
        if mode == "mcore-to-hf":
            result = HFCheckpointReader(dst_p)
        else:
            result = MegatronCheckpointView(find_latest(dst_p), config, locations)
        report.bit_exact_tensors = compare_bit_exact(source, result, f"{mode} {src_p} → {dst_p}")
    dist.barrier()
    if atol is None:
        ctx.destroy()
        return report.__dict__
    # (b) logits against transformers: a forward needs the model, so each rank holds its shard here.
    model = build()
    load_checkpoint(dst_p if mode != "mcore-to-hf" else src_p, ctx=ctx, chunks=model)
    positions = probe_tokens(config)  # past YaRN's original_max_position_embeddings when it has one
    if mode == "mcore-to-mcore":
        with tempfile.TemporaryDirectory(dir=dst_p) as tmp:
            reference = _shared_tmp(Path(tmp))
            if ctx.rank == 0:
                write_hf(source, reference, aux_from=hf_dir, progress=False)
            dist.barrier()
            logits, mtp = _check_logits(model, ctx, bridge, reference, atol, positions)
            dist.barrier()
    else:
        hf_ref = src_p if mode == "hf-to-mcore" else dst_p
        logits, mtp = _check_logits(model, ctx, bridge, hf_ref, atol, positions)
    report.mtp_logits_checks = [f"MTP layer {k}: {c.describe()}" for k, c in enumerate(mtp)]
    report.max_abs_mtp_logit_diffs = [c.max_abs_diff for c in mtp]
    if logits is not None:
        report.max_abs_logit_diff, report.logits_tolerance = logits.max_abs_diff, logits.tolerance
        report.logits_check = logits.describe()
    ctx.destroy()
    return report.__dict__


def _max_over_ranks(ctx: ParallelContext, value: int | None) -> int | None:
    values: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(values, value)
    return None if any(v is None for v in values) else max(values)


def _shared_tmp(tmp: Path) -> Path:
    """Rank 0's temporary directory name, agreed by every rank."""
    box = [str(tmp)]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])
