"""Per-sample tracing: a sample's id through the run's log file, and the per-step JSONL dump.

Every sample of a run has an id (``StepBatch.uids``, made by
:func:`rltrain.data.step_batch.step_uid_prefix`), e.g. ``step3-p0-s1``: step 3, prompt 0 of the step's
batch, its sample 1; ``step3-r1-p0-s1`` for dynamic sampling's round 1, ``step3-greedy-p0-s0`` for
ReMax's greedy baselines, ``step3-val-p0-s0`` for a validation after step 3.

Log lines, at :data:`~rltrain.logging.console.TRACE` on the ``rltrain.samples`` logger (the run's log
file, never the terminal: :mod:`rltrain.logging.console`); one per sample and stage::

    rollout step3-p0-s1: finish=stop length=5
    reward step3-p0-s1: score=1 correct=True
    advantage step3-p0-s1: mean=+0.707106 reward=+1 tokens=5

and one per worker rank and optimizer step (a Ray worker's lines reach the log file through its
forwarded stderr; a torchrun rank writes its own log file)::

    train actor rank 1 (dp 1/2) mini-batch 2/4: step3-p0-s1 step3-p2-s0

Dump (``trainer.rollout_data_dir``, ``trainer.validation_data_dir``): :func:`write_samples` writes
``<dir>/<step>.jsonl``, one JSON object per sample, to a temporary file renamed over the old one, so
a reader never sees half a file and a step run again after a resume replaces its file whole. The
fields are verl's (``_dump_generations``) where verl has one: ``input``, ``output``, ``gts``,
``score``, ``step``; and ``uid`` (this sample's id: verl's ``uid`` names a prompt's group),
``data_source``, ``acc``, ``reward``, ``advantage``, ``response_length``, ``finish_reason``
(:mod:`rltrain.trainer.sample_records` says what each holds).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rltrain.logging.console import TRACE

SAMPLES_LOGGER = "rltrain.samples"
"""The logger of the per-sample lines (``trainer.log_samples``)."""
log = logging.getLogger(SAMPLES_LOGGER)


def log_rollout(uids: Sequence[str], finish_reasons: Sequence[str], lengths: Sequence[int]) -> None:
    """One ``rollout`` line per sample: its finish reason and its response length in tokens."""
    if log.isEnabledFor(TRACE):
        for uid, reason, length in zip(uids, finish_reasons, lengths, strict=True):
            log.log(TRACE, "rollout %s: finish=%s length=%d", uid, reason, length)


def log_rewards(uids: Sequence[str], scores: Sequence[float], correct: Sequence[bool]) -> None:
    """One ``reward`` line per sample: its score (after any shaping) and whether it was correct."""
    if log.isEnabledFor(TRACE):
        for uid, score, ok in zip(uids, scores, correct, strict=True):
            log.log(TRACE, "reward %s: score=%.6g correct=%s", uid, score, bool(ok))


def log_advantages(
    uids: Sequence[str], means: Sequence[float], rewards: Sequence[float], tokens: Sequence[int]
) -> None:
    """One ``advantage`` line per sample: the mean advantage over its ``tokens`` sampled response
    tokens and its reward (the sum of its token-level rewards)."""
    if log.isEnabledFor(TRACE):
        for uid, mean, reward, count in zip(uids, means, rewards, tokens, strict=True):
            log.log(TRACE, "advantage %s: mean=%+.6g reward=%+.6g tokens=%d", uid, mean, reward, count)


def log_trained(
    role: str,
    *,
    rank: int,
    dp_rank: int,
    dp_size: int,
    mini_batch: int,
    num_mini_batches: int,
    uids: Sequence[str],
) -> None:
    """The ids one rank of ``role`` trained on in optimizer step ``mini_batch`` (from 0) of the update."""
    if log.isEnabledFor(TRACE):
        log.log(
            TRACE,
            "train %s rank %d (dp %d/%d) mini-batch %d/%d: %s",
            role,
            rank,
            dp_rank,
            dp_size,
            mini_batch + 1,
            num_mini_batches,
            " ".join(uids),
        )


def samples_path(directory: str | Path, step: int) -> Path:
    """The dump file of ``step`` in ``directory``."""
    return Path(directory) / f"{step}.jsonl"


def write_samples(directory: str | Path, step: int, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write ``rows`` (one JSON object each, non-ASCII kept) as ``<directory>/<step>.jsonl``, atomically;
    returns the path. Non-finite floats are written as ``null`` (JSON has no NaN)."""
    path = samples_path(directory, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({k: _finite(v) for k, v in row.items()}, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _finite(value: Any) -> Any:
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    return value
