"""Checkpoint conversion HF ↔ Megatron distributed checkpoint, and Megatron resharding, with verification.

Contract:
- ``hf_to_mcore(src, dst, tp=, pp=, ep=)`` writes ``dst/step_0`` + ``dst/latest`` (the trainer's
  checkpoint layout, ``rltrain.megatron.checkpoint``; loadable at any TP/PP/EP) and ``dst/hf/``
  (config, tokenizer and generation config, so the architecture travels with the weights).
- ``mcore_to_hf(src, dst)`` writes a (sharded) safetensors HF directory with those files copied.
- ``mcore_to_mcore(src, dst, tp=, pp=, ep=)`` reshards a Megatron checkpoint (model weights).

Before any rank starts (``inputs.check_inputs``), a bad input raises ``ConversionError`` in one line
naming the culprit: the source files, the HF config and its model family, every layout the model
cannot take, a non-empty ``dst`` (cleared only with ``overwrite=True``). Then ``tp × pp × ep`` gloo
ranks (forks of a server that has done their imports, ``rltrain.local_ranks``) stream the conversion
one tensor at a time into a staging directory beside ``dst`` and, unless ``verify=False``, verify it
(``ranks.rank_main``: bit-exact round trip of every tensor; unless ``atol`` is None, the logits on a
probe batch against transformers in the checkpoint's dtype). Only when every rank succeeded is the
staging directory renamed to ``dst``; otherwise it is removed, so a failed conversion or
verification leaves nothing that looks complete. A rank's unreadable checkpoint file, failed
verification or unsupported feature raises ``ConversionError`` with its one-line message; any other
failure ``RuntimeError`` with the rank's traceback. The rendezvous port stays held
(``rltrain.ports.HeldPort``) until the ranks are done, so nothing else on the machine can take it
before rank 0 binds it. Returns rank 0's ``ConversionReport``.
"""

from __future__ import annotations

import os
import queue
import shutil
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from megatron_bridge.errors import CheckpointError, VerificationError
from megatron_bridge.memory import return_freed_tensors_to_os
from rltrain.convert.inputs import check_inputs, staging_dir
from rltrain.convert.report import ConversionError, ConversionReport
from rltrain.local_ranks import rank_context, rank_process
from rltrain.ports import HeldPort

_ONE_LINE = (CheckpointError, VerificationError, ConversionError, NotImplementedError)
"""Failures on a rank that are about the input (said in one line), not a bug (said with a traceback)."""


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
    except _ONE_LINE as err:
        queue.put((rank, "failed", str(err)))
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
    overwrite: bool = False,
    timeout_s: float = 3600,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    etp: int | None = None,
) -> ConversionReport:
    """Run one conversion on ``tp × pp × ep`` spawned gloo ranks; raises ``ConversionError`` (one line)
    for a bad input or a failed verification, ``RuntimeError`` with the failing rank's traceback else.

    ``hf_config_dir``: for a Megatron source, where its HF config and tokenizer are (default
    ``src/hf``, which conversions and the trainer's actor checkpoints carry). ``overwrite``: clear a
    non-empty ``dst`` first (refused otherwise). ``first_stage_layers`` / ``last_stage_layers``: decoder
    layers on the first / last pipeline stage (Megatron-Core's uneven PP; default an even split).
    ``etp``: expert tensor-parallel size (default ``tp``), carved out of the same ``tp × pp × ep`` ranks.
    """
    src, dst = Path(src), Path(dst)
    hf_dir = check_inputs(
        mode,
        src,
        dst,
        hf_config_dir=hf_config_dir,
        tp=tp,
        pp=pp,
        ep=ep,
        overwrite=overwrite,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        etp=etp,
    )
    if dst.exists():  # empty, or cleared with --overwrite: the staging directory takes its place
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(dst)
    if staging.exists():  # left by a conversion that was killed
        shutil.rmtree(staging)
    stages = (first_stage_layers, last_stage_layers)
    args = (mode, str(src), str(staging), str(hf_dir), tp, pp, ep, verify, atol, stages, etp)
    try:
        report = _run_ranks(mode, args, tp * pp * ep, timeout_s)
        staging.rename(dst)
    except ConversionError as err:
        raise ConversionError(f"{err}; nothing was written to {dst}") from None
    finally:
        if staging.exists():  # a failure's partial output (after the rename there is none)
            shutil.rmtree(staging)
    return report


def _run_ranks(mode: str, args: tuple, world: int, timeout_s: float) -> ConversionReport:
    mp_ctx = rank_context()
    answers = mp_ctx.Queue()
    with HeldPort("127.0.0.1") as port:
        procs = [rank_process(mp_ctx, _entry, r, world, port.port, args, answers) for r in range(world)]
        for proc in procs:
            proc.start()
        try:
            results = _gather(mode, procs, answers, timeout_s)
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    return ConversionReport(**results[0])


def _gather(mode: str, procs: list, answers: Any, timeout_s: float) -> dict[int, Any]:
    """Every rank's report; raises at the first failure, a rank that died or ``timeout_s`` passing."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(procs):
        try:
            rank, status, value = answers.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
            if dead:
                codes = ", ".join(f"rank {r} exit code {procs[r].exitcode}" for r in dead)
                raise RuntimeError(f"{mode}: a conversion rank died without an answer ({codes})") from None
            if time.monotonic() > deadline:
                waiting = [r for r in range(len(procs)) if r not in results]
                raise ConversionError(
                    f"{mode}: ranks {waiting} did not finish within {timeout_s:g} s"
                ) from None
            continue
        if status == "failed":
            raise ConversionError(f"rank {rank}: {value}")
        if status == "error":
            _raise_root_cause(answers)
            raise RuntimeError(f"{mode} failed on rank {rank}:\n{value}")
        results[rank] = value
    return results


def _raise_root_cause(answers: Any, wait_s: float = 5.0) -> None:
    """After a rank's traceback, a moment for a one-line failure of another rank to arrive: a rank
    whose input failed leaves its peers failing in a collective, and the input is the cause to name."""
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            rank, status, value = answers.get(timeout=left)
        except queue.Empty:
            return
        if status == "failed":
            raise ConversionError(f"rank {rank}: {value}")


def hf_to_mcore(src: str | Path, dst: str | Path, **kwargs: Any) -> ConversionReport:
    return run_conversion("hf-to-mcore", src, dst, **kwargs)


def mcore_to_hf(src: str | Path, dst: str | Path, **kwargs: Any) -> ConversionReport:
    return run_conversion("mcore-to-hf", src, dst, **kwargs)


def mcore_to_mcore(src: str | Path, dst: str | Path, **kwargs: Any) -> ConversionReport:
    return run_conversion("mcore-to-mcore", src, dst, **kwargs)
