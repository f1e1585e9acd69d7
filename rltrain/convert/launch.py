"""Checkpoint conversion HF ↔ Megatron distributed checkpoint, and Megatron resharding, with verification.

Contract:
- ``hf_to_mcore(src, dst, tp=, pp=, ep=)`` writes ``dst/step_0`` + ``dst/latest`` (the trainer's
  checkpoint layout, ``rltrain.megatron.checkpoint``; loadable at any TP/PP/EP) and ``dst/hf/``
  (config, tokenizer and generation config, so the architecture travels with the weights).
- ``mcore_to_hf(src, dst)`` writes a (sharded) safetensors HF directory with those files copied.
- ``mcore_to_mcore(src, dst, tp=, pp=, ep=)`` reshards a Megatron checkpoint (model weights).
Each checks its inputs before any rank starts (naming the missing directory or file), then launches
``tp × pp × ep`` gloo ranks (spawned processes) that stream the conversion one tensor at a time and,
unless ``verify=False``, verify it (``ranks.rank_main``: bit-exact round trip of every tensor, and
the logits on a probe batch within ``atol`` of transformers'; ``atol=None`` skips the logits). A
failing rank's traceback is raised as ``RuntimeError``. Returns rank 0's ``ConversionReport``.
"""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path
from typing import Any

import torch

from megatron_bridge.hf_io import HFCheckpointReader
from megatron_bridge.memory import return_freed_tensors_to_os
from rltrain.convert.report import MODES, ConversionReport


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
        from rltrain.convert.ranks import rank_main  # Megatron and transformers: on the ranks only

        queue.put((rank, "ok", rank_main(*args)))
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
    atol: float | None = 1e-4,
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
