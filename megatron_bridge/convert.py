"""Checkpoint conversion HF ↔ Megatron distributed checkpoint, and Megatron resharding, with verification.

Contract:
- ``hf_to_mcore(src, dst, tp=, pp=, ep=)`` writes ``dst/step_0`` + ``dst/latest`` (the trainer's
  checkpoint layout, ``rltrain.megatron.checkpoint``; loadable at any TP/PP/EP) and ``dst/hf/``
  (config, tokenizer and generation config, so the architecture travels with the weights).
- ``mcore_to_hf(src, dst)`` writes a (sharded) safetensors HF directory with those files copied.
- ``mcore_to_mcore(src, dst, tp=, pp=, ep=)`` reshards a Megatron checkpoint (model weights).
Each launches ``tp × pp × ep`` gloo ranks (spawned processes) that build the model on the meta
device: it describes the layout (shapes, Megatron's checkpoint keys) and holds no weights.
Every mode streams one tensor at a time: HF tensors are read one conversion unit at a time
(``hf_io``), Megatron checkpoints are read region by region (``dcp_io``; ``mcore_view`` presents
one under HF names), and Megatron checkpoints are written by a writer that produces each stored
chunk right before writing it (``rltrain.megatron.streamed_checkpoint``). A rank's peak memory grows
by a few of the largest tensors, whatever the model size (``ConversionReport.peak_memory_growth_bytes``,
measured on every rank over the conversion). Unless ``verify=False``: (a) every tensor of the
result, read back in the source's terms, must be bit-identical to the source (names, shapes, dtypes,
bytes; streamed too); (b) the Megatron logits on a probe batch must match transformers' within
``atol`` (this forward holds each rank's shard of the model, as any forward must). Failures raise
naming the tensors. Returns a ``ConversionReport`` (from rank 0).
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
    """The largest growth of any rank's peak resident memory while converting (None: not measured)."""
    largest_tensor_bytes: int | None = None
    checkpoint_bytes: int | None = None
    """Bytes of all tensors of the source checkpoint (in HF terms)."""
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
                f"  peak memory while converting: +{growth / 2**20:.1f} MiB on the busiest rank "
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


def _compare(expected: Any, actual: Any, what: str) -> int:
    """Compare every tensor of two readers bit-for-bit, one at a time; raises naming the differences."""
    if sorted(expected.names()) != sorted(actual.names()):
        missing = sorted(set(expected.names()) - set(actual.names()))
        unexpected = sorted(set(actual.names()) - set(expected.names()))
        raise AssertionError(f"{what}: missing tensors {missing[:20]}; unexpected tensors {unexpected[:20]}")
    bad = []
    for name in expected.names():
        ref, got = expected.get(name), actual.get(name)
        if got.dtype != ref.dtype or got.shape != ref.shape or not torch.equal(got, ref):
            bad.append(f"{name} ({tuple(got.shape)} {got.dtype} vs {tuple(ref.shape)} {ref.dtype})")
    if bad:
        raise AssertionError(f"{what}: round trip differs for {bad[:20]}")
    return len(expected.names())


def _locations(chunks, ctx, bridge) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every canonical parameter's (checkpoint key, index), gathered from all ranks (collective)."""
    import torch.distributed as dist

    from megatron_bridge.live import chunk_namings
    from rltrain.megatron.checkpoint import checkpoint_keys

    mine = {
        naming.to_canonical(local): where
        for naming, keys in zip(chunk_namings(chunks, ctx, bridge), checkpoint_keys(chunks))
        for local, where in keys.items()
    }
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    return {name: where for part in gathered for name, where in part.items()}


def _write_hf(view: Any, out: Path, *, aux_from: Path, progress: bool) -> None:
    """Write every tensor of ``view`` (an HF-named reader) as a safetensors directory, one at a time."""
    writer = SafetensorsWriter(out, [(n, view.info(n).shape, view.info(n).dtype) for n in view.names()])
    for name in _progress(view.names(), progress, "write HF checkpoint"):
        writer.write(name, view.get(name))
    writer.close()
    copy_hf_aux_files(aux_from, out)


def _progress(items: list, enabled: bool, desc: str):
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="tensor")


_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _reshard_source(stored: Any):
    """The streamed writer's source for mcore-to-mcore: each stored region read from the old checkpoint."""

    def source(region: Any, placeholder: torch.Tensor) -> torch.Tensor:
        have = stored.shape(region.key)
        vocab = region.key in _VOCAB_KEYS and have[1:] == region.global_shape[1:]
        if have != region.global_shape and not vocab:
            raise ValueError(
                f"{stored.directory}: {region.key!r} is stored as {have}; the target layout expects "
                f"{region.global_shape}"
            )
        return stored.read(region.key, region.offsets, region.sizes, pad_rows=vocab).view(placeholder.shape)

    return source


def _rank_main(
    mode: str, src: str, dst: str, hf: str, tp: int, pp: int, ep: int, verify: bool, atol: float | None
) -> dict:
    import torch.distributed as dist

    from megatron_bridge.dcp_io import DistCheckpointReader
    from megatron_bridge.live import LazyShards
    from megatron_bridge.mcore_view import MegatronCheckpointView
    from rltrain.megatron.checkpoint import find_latest, load_checkpoint, save_checkpoint
    from rltrain.megatron.streamed_checkpoint import StreamedSaveStrategy

    if mode not in ("hf-to-mcore", "mcore-to-hf", "mcore-to-mcore"):
        raise ValueError(
            f"unknown conversion mode {mode!r}; expected hf-to-mcore, mcore-to-hf, mcore-to-mcore"
        )
    src_p, dst_p, hf_dir = Path(src), Path(dst), Path(hf)
    config, ctx, build, chunks, bridge = _setup(hf_dir, tp, pp, ep, meta=True)
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
        strategy = StreamedSaveStrategy(_reshard_source(DistCheckpointReader(src_step)), progress=progress)
        save_checkpoint(dst_p, step=0, ctx=ctx, chunks=chunks, sharded_strategy=strategy)
    elif ctx.rank == 0:
        _write_hf(source, dst_p, aux_from=hf_dir, progress=progress)
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
        report.bit_exact_tensors = _compare(source, result, f"{mode} {src_p} → {dst_p}")
    dist.barrier()
    if atol is None:
        ctx.destroy()
        return report.__dict__
    # (b) logits against transformers: a forward needs the model, so each rank holds its shard here.
    model = build()
    load_checkpoint(dst_p if mode != "mcore-to-hf" else src_p, ctx=ctx, chunks=model)
    if mode == "mcore-to-mcore":
        with tempfile.TemporaryDirectory(dir=dst_p) as tmp:
            reference = _shared_tmp(ctx, Path(tmp))
            if ctx.rank == 0:
                _write_hf(source, reference, aux_from=hf_dir, progress=False)
            dist.barrier()
            report.max_abs_logit_diff = _check_logits(model, ctx, bridge, reference, atol)
            dist.barrier()
    else:
        report.max_abs_logit_diff = _check_logits(
            model, ctx, bridge, src_p if mode == "hf-to-mcore" else dst_p, atol
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
MODES = ("hf-to-mcore", "mcore-to-hf", "mcore-to-mcore")


def _check_inputs(mode: str, src: Path, hf_config_dir: str | Path | None) -> Path:
    """The HF directory with the model's config; fails before any rank starts, naming what is missing."""
    if mode not in MODES:
        raise ValueError(f"unknown conversion mode {mode!r}; expected one of {', '.join(MODES)}")
    if mode == "hf-to-mcore":
        HFCheckpointReader(src)  # raises naming the directory without safetensors
        hf_dir = src
    else:
        if not (src / "latest").is_file():
            raise FileNotFoundError(
                f"{src}: no Megatron checkpoint ({src / 'latest'} is missing); pass the directory that "
                "holds `latest`, e.g. a conversion's output or a run's checkpoints/step_N/actor"
            )
        hf_dir = Path(hf_config_dir) if hf_config_dir is not None else src / "hf"
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{hf_dir / 'config.json'} is missing: the HF config (and tokenizer) of the model"
            + ("" if mode == "hf-to-mcore" else "; pass --hf-config DIR (the model it was trained from)")
        )
    return hf_dir


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
    hf_config_dir: str | Path | None = None,
    timeout_s: float = 3600,
) -> ConversionReport:
    """Run one conversion on ``tp × pp × ep`` spawned gloo ranks; raises with the failing rank's traceback.

    ``hf_config_dir``: for a Megatron source, where its HF config and tokenizer are (default
    ``src/hf``, which conversions and the trainer's actor checkpoints carry).
    """
    import torch.multiprocessing as mp

    hf_dir = _check_inputs(mode, Path(src), hf_config_dir)
    world = tp * pp * ep
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp_ctx = mp.get_context("spawn")
    queue = mp_ctx.Queue()
    args = (mode, str(src), str(dst), str(hf_dir), tp, pp, ep, verify, atol)
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
