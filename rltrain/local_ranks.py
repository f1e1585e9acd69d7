"""Processes for the ranks a launcher starts on this machine, forked from a server that has done the
imports every rank needs, instead of one fresh interpreter per rank.

A rank of a conversion (or of a test's gloo group) spends seconds importing torch, Megatron-Core and
transformers before its first line of work: about 6 s of CPU each, so 8 ranks on 2 cores wait about
25 s before they start. ``rank_context()`` is multiprocessing's ``forkserver`` context with those
modules preloaded: the server (one per parent process, started on first use, kept for the parent's
life) imports them once, and every rank is a fork of it that starts at once. On a machine with an
NVIDIA device it is ``spawn`` as before: the imports query CUDA, and a process forked after that
cannot use it ("Cannot re-initialize CUDA in forked subprocess").

Contract: ``rank_context()`` returns the context; ``rank_process(ctx, fn, *args)`` is a process
of it (not started) that runs ``fn(*args)`` in the parent's environment variables of the moment it
was made (a forked rank would otherwise have the server's, from when it started). The server has imported nothing that starts a
thread, a process group or a device context, so each rank initialises those itself as a fresh
interpreter would; modules imported by the server see the environment as it was then (as they would
have been imported once anyway). ``fn`` and its arguments are pickled, as with ``spawn``: ``fn``
must be importable by name.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from typing import Any

# What every rank imports first; a module that fails to import is skipped by the server (the rank
# then imports it, or fails, itself).
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "megatron.core",
    "megatron.core.dist_checkpointing",
    "rltrain.megatron.cpu_compat",
    "rltrain.megatron.worker",
]


def rank_context() -> Any:
    """``torch.multiprocessing``'s forkserver context with ``PRELOAD`` (torch's tensor sharing
    over queues included); its spawn context where an NVIDIA device is present."""
    import torch.multiprocessing as mp

    if glob.glob("/dev/nvidia[0-9]*"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def rank_process(ctx: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """A process of ``ctx`` (not started) running ``fn(*args)`` in this process's environment."""
    return ctx.Process(target=_in_environment, args=(dict(os.environ), fn, *args))


def _in_environment(env: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    os.environ.clear()
    os.environ.update(env)
    return fn(*args)
