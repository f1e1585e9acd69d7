"""Checkpoint conversion HF ↔ Megatron distributed checkpoint, and Megatron resharding, with verification.

Contract:
- ``hf_to_mcore(src, dst, tp=, pp=, ep=)`` writes ``dst/step_0`` + ``dst/latest`` (the trainer's
  checkpoint layout, ``rltrain.megatron.checkpoint``; loadable at any TP/PP/EP) and ``dst/hf/``
  (config, tokenizer and generation config, so the architecture travels with the weights).
- ``mcore_to_hf(src, dst)`` writes a (sharded) safetensors HF directory with those files copied.
- ``mcore_to_mcore(src, dst, tp=, pp=, ep=)`` reshards a Megatron checkpoint.
Each launches ``tp × pp × ep`` gloo ranks (spawned processes). HF tensors are read and written one
conversion unit at a time (see ``hf_io``). hf-to-mcore never holds a model shard: the model is
built on the meta device and each tensor is read from HF inside the checkpoint writer, written and
dropped (``streamed_save``), so a rank's peak memory grows by a few of the largest tensors
(measured: ``ConversionReport.peak_memory_growth_bytes``). The other modes, and verification, hold
each rank's own shard of the model. Unless ``verify=False``, the result is reloaded from disk and
(a) every tensor converted back to the source layout must be bit-identical (names, shapes, dtypes,
bytes), (b) the Megatron logits on a probe batch must match transformers' within ``atol``.
Failures raise naming the tensors. Returns a ``ConversionReport`` (from rank 0).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_bridge.hf_io import HFCheckpointReader, SafetensorsWriter, copy_hf_aux_files
from megatron_bridge.memory import PeakMemory, return_freed_tensors_to_os


@dataclass
class ConversionReport:
    mode: str
    layout: dict[str, int]
    num_tensors: int = 0
    bit_exact_tensors: int | None = None
    """Tensors compared bit-for-bit after converting back (None: not verified)."""
    max_abs_logit_diff: float | None = None
    peak_memory_growth_bytes: int | None = None
    """hf-to-mcore: the largest growth of any rank's peak resident memory while writing (None: not measured)."""
    largest_tensor_bytes: int | None = None
    checkpoint_bytes: int | None = None
    """Bytes of all HF tensors of the source checkpoint."""
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [
            f"{self.mode} at TP={self.layout['tp']} PP={self.layout['pp']} EP={self.layout['ep']}: "
            f"{self.num_tensors} tensors"
        ]
        if self.bit_exact_tensors is not None:
            lines.append(f"  round trip: {self.bit_exact_tensors} tensors bit-exact")
        if self.max_abs_logit_diff is not None:
            lines.append(f"  logits vs transformers: max abs diff {self.max_abs_logit_diff:.3e}")
        if self.peak_memory_growth_bytes is not None and self.largest_tensor_bytes:
            growth = self.peak_memory_growth_bytes
            lines.append(
                f"  peak memory while writing: +{growth / 2**20:.1f} MiB on the busiest rank "
                f"({growth / self.largest_tensor_bytes:.2f}× the largest tensor, "
                f"{growth / self.checkpoint_bytes:.3f}× the checkpoint)"
            )
        return "\n".join(lines + [f"  {n}" for n in self.notes])


# ---- rank-side work ------------------------------------------------------------------------------
def _setup(hf_config_dir: Path, tp: int, pp: int, ep: int, *, meta: bool = False):
    from transformers import AutoConfig

    from megatron_bridge.live import bridge_for_chunks
    from megatron_bridge.megatron_model import build_padded_model
    from rltrain.config.parallel import ParallelConfig
    from rltrain.megatron.parallel import ParallelContext

    config = AutoConfig.from_pretrained(hf_config_dir)
    ctx = ParallelContext.initialize(
        ParallelConfig(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
        )
    )
    dtype = getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype

    def build():
        return build_padded_model(config, ctx, dtype=dtype)

    chunks = build_padded_model(config, ctx, dtype=dtype, meta=True) if meta else build()
    return config, ctx, build, chunks, bridge_for_chunks(config, chunks, ctx)


def _check_logits(chunks, ctx, bridge, hf_dir: Path, atol: float | None) -> float | None:
    """Max abs logit diff vs transformers on rank 0 (None elsewhere, or when ``atol`` is None: skipped)."""
    if atol is None:
        return None
    from megatron_bridge.verify import hf_logits, megatron_logits, probe_batch

    ids = probe_batch(bridge.dims.vocab_size)
    ours = megatron_logits(chunks, ctx, ids, vocab_size=bridge.dims.vocab_size)
    if ctx.rank != 0:
        return None
    diff = (ours - hf_logits(hf_dir, ids)).abs().max().item()
    if not diff <= atol:
        raise AssertionError(
            f"logits of the converted model differ from transformers by {diff:.3e} > atol {atol}"
        )
    return diff


def _compare_export(chunks, ctx, bridge, reader: HFCheckpointReader, *, progress: bool) -> int:
    """Export ``chunks`` as HF tensors and compare each bit-for-bit with ``reader`` (rank 0)."""
    from megatron_bridge.live import export_hf_weights

    bad, count = [], 0
    for name, tensor in export_hf_weights(chunks, ctx, bridge, progress=progress):
        ref = reader.get(name)
        if tensor.dtype != ref.dtype or tensor.shape != ref.shape or not torch.equal(tensor, ref):
            bad.append(f"{name} ({tuple(tensor.shape)} {tensor.dtype} vs {tuple(ref.shape)} {ref.dtype})")
        count += 1
    if ctx.rank == 0 and (bad or count != len(reader.names())):
        raise AssertionError(
            f"round trip differs for {bad[:20]}; exported {count} of {len(reader.names())} tensors"
        )
    return count


def _compare_params(chunks_a, chunks_b, ctx) -> int:
    """Bit-compare two equally laid out chunk lists (every rank); returns the global count."""
    import torch.distributed as dist

    bad, count = [], 0
    for a, b in zip(chunks_a, chunks_b):
        pb = dict(b.named_parameters())
        for name, p in a.named_parameters():
            if name not in pb or p.dtype != pb[name].dtype or not torch.equal(p, pb[name]):
                bad.append(name)
            count += 1
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, (bad, count))
    bad_all = [f"rank {r}: {n}" for r, (names, _) in enumerate(gathered) for n in names]
    if bad_all:
        raise AssertionError(f"reloaded checkpoint differs for {bad_all[:20]}")
    return sum(c for _, c in gathered)


def _export_to_dir(chunks, ctx, bridge, out: Path, *, aux_from: Path, progress: bool) -> int:
    """Write chunks as an HF safetensors directory from rank 0 (collective); returns tensor count."""
    import torch.distributed as dist

    from megatron_bridge.live import export_hf_weights, hf_plan

    plan = hf_plan(chunks, ctx, bridge)
    writer = SafetensorsWriter(out, plan) if ctx.rank == 0 else None
    count = 0
    for name, tensor in export_hf_weights(chunks, ctx, bridge, progress=progress):
        writer.write(name, tensor)
        count += 1
    if writer is not None:
        writer.close()
        copy_hf_aux_files(aux_from, out)
    dist.barrier()
    return count


def write_mcore_from_hf(
    reader: HFCheckpointReader, dst: Path, *, ctx: Any, chunks: list, bridge: Any, progress: bool = False
) -> PeakMemory:
    """Write ``dst/step_0`` from ``reader`` for ``chunks`` (meta device), one tensor at a time (collective).

    Returns this rank's peak memory over the write.
    """
    from megatron_bridge.live import LazyShards
    from megatron_bridge.streamed_save import save_model_checkpoint

    memory = PeakMemory.start()
    shards = LazyShards(chunks, ctx, bridge, reader, progress=progress)
    save_model_checkpoint(dst, step=0, ctx=ctx, chunks=chunks, shards=shards)
    shards.close()
    return memory.stop()


def _rank_main(
    mode: str, src: str, dst: str, tp: int, pp: int, ep: int, verify: bool, atol: float | None
) -> dict:
    from megatron_bridge.live import load_hf_weights
    from rltrain.megatron.checkpoint import load_checkpoint, save_checkpoint

    src_p, dst_p = Path(src), Path(dst)
    hf_dir = src_p if mode == "hf-to-mcore" else src_p / "hf"
    _, ctx, build, chunks, bridge = _setup(hf_dir, tp, pp, ep, meta=mode == "hf-to-mcore")
    progress = ctx.rank == 0
    report = ConversionReport(mode, {"tp": tp, "pp": pp, "ep": ep})
    if mode == "hf-to-mcore":
        reader = HFCheckpointReader(src_p)
        memory = write_mcore_from_hf(reader, dst_p, ctx=ctx, chunks=chunks, bridge=bridge, progress=progress)
        report.peak_memory_growth_bytes = _max_over_ranks(ctx, memory.growth_bytes)
        report.largest_tensor_bytes = max(reader.info(n).nbytes for n in reader.names())
        report.checkpoint_bytes = reader.total_bytes()
        if ctx.rank == 0:
            (dst_p / "hf").mkdir(exist_ok=True)
            copy_hf_aux_files(src_p, dst_p / "hf")
        report.num_tensors = len(reader.names())
        if verify:
            reloaded = build()
            load_checkpoint(dst_p, ctx=ctx, chunks=reloaded)
            report.bit_exact_tensors = _compare_export(reloaded, ctx, bridge, reader, progress=False)
            report.max_abs_logit_diff = _check_logits(reloaded, ctx, bridge, src_p, atol)
    elif mode == "mcore-to-hf":
        load_checkpoint(src_p, ctx=ctx, chunks=chunks)
        report.num_tensors = _export_to_dir(chunks, ctx, bridge, dst_p, aux_from=hf_dir, progress=progress)
        if verify:
            reloaded = build()
            load_hf_weights(reloaded, ctx, bridge, HFCheckpointReader(dst_p), progress=False)
            report.bit_exact_tensors = _compare_params(chunks, reloaded, ctx)
            report.max_abs_logit_diff = _check_logits(chunks, ctx, bridge, dst_p, atol)
    elif mode == "mcore-to-mcore":
        load_checkpoint(src_p, ctx=ctx, chunks=chunks)
        save_checkpoint(dst_p, step=0, ctx=ctx, chunks=chunks)
        if ctx.rank == 0:
            (dst_p / "hf").mkdir(exist_ok=True)
            copy_hf_aux_files(hf_dir, dst_p / "hf")
        report.num_tensors = len(bridge.hf_names())
        if verify:
            reloaded = build()
            load_checkpoint(dst_p, ctx=ctx, chunks=reloaded)
            report.bit_exact_tensors = _compare_params(chunks, reloaded, ctx)
            with tempfile.TemporaryDirectory(dir=dst_p) as tmp:
                tmp_b = _shared_tmp(ctx, Path(tmp))
                _export_to_dir(reloaded, ctx, bridge, tmp_b, aux_from=hf_dir, progress=False)
                report.max_abs_logit_diff = _check_logits(reloaded, ctx, bridge, tmp_b, atol)
    else:
        raise ValueError(
            f"unknown conversion mode {mode!r}; expected hf-to-mcore, mcore-to-hf, mcore-to-mcore"
        )
    ctx.destroy()
    return report.__dict__


def _max_over_ranks(ctx, value: int | None) -> int | None:
    import torch.distributed as dist

    values: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(values, value)
    return None if any(v is None for v in values) else max(values)


def _shared_tmp(ctx, tmp: Path) -> Path:
    """Rank 0's temporary directory name, agreed by every rank."""
    import torch.distributed as dist

    box = [str(tmp)]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


# ---- launcher ------------------------------------------------------------------------------------
def _entry(rank: int, world: int, port: int, args: tuple, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return_freed_tensors_to_os()
    try:
        queue.put((rank, "ok", _rank_main(*args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_conversion(
    mode: str,
    src: str | Path,
    dst: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    verify: bool = True,
    atol: float = 1e-4,
    timeout_s: float = 3600,
) -> ConversionReport:
    """Run one conversion on ``tp × pp × ep`` spawned gloo ranks; raises with the failing rank's traceback."""
    import torch.multiprocessing as mp

    world = tp * pp * ep
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp_ctx = mp.get_context("spawn")
    queue = mp_ctx.Queue()
    args = (mode, str(src), str(dst), tp, pp, ep, verify, atol)
    procs = [mp_ctx.Process(target=_entry, args=(r, world, port, args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout_s)
            if status == "error":
                raise RuntimeError(f"{mode} failed on rank {rank}:\n{value}")
            results[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return ConversionReport(**results[0])


def hf_to_mcore(src: str | Path, dst: str | Path, **kwargs: Any) -> ConversionReport:
    return run_conversion("hf-to-mcore", src, dst, **kwargs)


def mcore_to_hf(src: str | Path, dst: str | Path, **kwargs: Any) -> ConversionReport:
    return run_conversion("mcore-to-hf", src, dst, **kwargs)


def mcore_to_mcore(src: str | Path, dst: str | Path, **kwargs: Any) -> ConversionReport:
    return run_conversion("mcore-to-mcore", src, dst, **kwargs)


def report_json(report: ConversionReport) -> str:
    return json.dumps(report.__dict__, indent=2)
