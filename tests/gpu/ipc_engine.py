"""A ``VllmEngine`` whose workers are processes of their own on this GPU, without vLLM.

What runs is rltrain's own GPU hand-off: ``VllmEngine.receive`` → ``_load_bucket_remote`` →
``worker_fns.share_per_worker_cuda_ipc`` (each worker's regions packed into a device buffer, sent
as its CUDA IPC handle) → ``collective_rpc(worker_fns.load_regions, (parcels, mode))`` → in every
worker process ``worker_fns.load_regions``: the buffer rebuilt on that process's device, unpacked,
the regions put into full-shaped tensors and handed to the worker's ``reload_weights``.

Replaced, because vLLM is not installed where this runs:
- ``ProcessWorkers`` stands in for vLLM's ``LLM``: its ``collective_rpc`` pickles the function (or
  a worker method's name) and arguments to every worker process, runs ``fn(worker, *args)`` there
  and returns the results in rank order, as vLLM's multiprocess executor does.
- In each worker process, the two vLLM calls ``load_regions`` makes (its TP rank, and the platform
  check of ``finish_reload``), and the vLLM worker: ``reload_weights`` records a SHA-256 of the
  part of each tensor the worker reads (``record``), or copies each tensor into a preallocated
  device tensor of its name, as a model's load would (``copy``).

A worker process is this file run as a script; frames on its stdin/stdout are an 8-byte length and
a pickle. Every wait for a worker has a timeout that names the worker and what it waited for.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import select
import struct
import subprocess
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
Slices = list[tuple[int, int]]
"""A region as ``[(start, stop)]`` per dimension."""


def region_digest(tensor: torch.Tensor, region: Slices | None = None) -> str:
    """SHA-256 of the bytes of ``tensor[region]`` (its dtype's bytes, row-major)."""
    if region is not None:
        tensor = tensor[tuple(slice(a, b) for a, b in region)]
    return hashlib.sha256(
        tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    ).hexdigest()


# ---- the worker process ---------------------------------------------------------------------------
class _Model(torch.nn.Module):
    """What ``model_runner.get_model()`` returns: no modules, so no MoE or tied copies to repack."""


class FakeVllmWorker:
    """The vLLM worker that ``worker_fns`` functions receive as their first argument.

    ``mode="record"``: ``reload_weights`` records ``{name: (dtype, shape, device, digest)}``, the
    digest over ``reads[name]`` (the region this worker reads; the whole tensor when absent).
    ``mode="copy"``: ``reload_weights`` copies each tensor into ``targets[name]``, allocated on this
    worker's device from ``shapes`` (``{name: (shape, dtype)}``) at start.
    """

    def __init__(self, rank: int, mode: str, reads: dict[str, Slices], shapes: dict[str, Any]) -> None:
        self.rank, self.mode, self.reads = rank, mode, reads
        self.model_runner = types.SimpleNamespace(get_model=_Model)
        device = torch.device("cuda", torch.cuda.current_device())
        self.targets = {n: torch.empty(s, dtype=d, device=device) for n, (s, d) in shapes.items()}
        self.records: dict[str, tuple[str, tuple[int, ...], str, str]] = {}
        self.num_loads = 0

    def reload_weights(self, weights_iterator: Any, is_checkpoint_format: bool) -> None:
        if not is_checkpoint_format:
            raise ValueError("load_regions must pass checkpoint-format (HF-named) tensors")
        self.num_loads += 1
        for name, tensor in weights_iterator:
            if self.mode == "copy":
                self.targets[name].copy_(tensor)
            else:
                digest = region_digest(tensor, self.reads.get(name))
                self.records[name] = (str(tensor.dtype), tuple(tensor.shape), str(tensor.device), digest)

    def take_records(self) -> dict[str, Any]:
        """What ``record`` saw since the last call, and how many loads it took."""
        out = {"records": self.records, "num_loads": self.num_loads}
        self.records, self.num_loads = {}, 0
        return out

    def target_digests(self) -> dict[str, str]:
        """``copy`` mode: SHA-256 of every target tensor."""
        torch.cuda.synchronize()
        return {name: region_digest(t) for name, t in self.targets.items()}


def _install_vllm_stand_ins(rank: int) -> None:
    """``vllm.distributed.get_tensor_model_parallel_rank`` and ``vllm.platforms.current_platform``,
    the only vLLM names ``load_regions`` reaches (the real vLLM, if installed, is not imported)."""
    platform = types.SimpleNamespace(is_cpu=lambda: False, is_cuda_alike=lambda: True)
    modules = {
        "vllm": types.ModuleType("vllm"),
        "vllm.distributed": types.ModuleType("vllm.distributed"),
        "vllm.platforms": types.ModuleType("vllm.platforms"),
    }
    modules["vllm.distributed"].get_tensor_model_parallel_rank = lambda: rank  # type: ignore[attr-defined]
    modules["vllm.platforms"].current_platform = platform  # type: ignore[attr-defined]
    sys.modules.update(modules)


def _write_frame(stream: Any, obj: Any) -> None:
    payload = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(payload)) + payload)
    stream.flush()


def _read_frame_blocking(stream: Any) -> Any:
    header = stream.read(8)
    if len(header) < 8:
        return None
    (size,) = struct.unpack("<Q", header)
    return pickle.loads(stream.read(size))


def worker_main(rank: int) -> None:
    """Serve ``collective_rpc`` calls on stdin/stdout until a ``None`` frame or end of input."""
    frames = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr; stdout carries frames only
    requests = sys.stdin.buffer
    _install_vllm_stand_ins(rank)
    setup = _read_frame_blocking(requests)
    torch.cuda.set_device(0)
    worker = FakeVllmWorker(rank, **setup)
    _write_frame(frames, ("ready", torch.cuda.get_device_name()))
    while (request := _read_frame_blocking(requests)) is not None:
        fn, args, kwargs = request
        try:
            result = (
                getattr(worker, fn)(*args, **kwargs) if isinstance(fn, str) else fn(worker, *args, **kwargs)
            )
            _write_frame(frames, ("ok", result))
        except BaseException:
            _write_frame(frames, ("error", traceback.format_exc()))


# ---- the driving process --------------------------------------------------------------------------
class ProcessWorkers:
    """``num_workers`` worker processes on this GPU, driven like vLLM's ``LLM`` (``collective_rpc``).

    ``reads[rank]``: the regions each worker reads (``record`` mode); ``shapes``: the tensors a
    ``copy`` worker holds. ``frame_bytes`` lists the size of every request sent (what crossed the
    process boundary: handles and metadata, never the weights).
    """

    def __init__(
        self,
        num_workers: int,
        *,
        mode: str,
        reads: list[dict[str, Slices]] | None = None,
        shapes: dict[str, Any] | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        self.timeout_s = timeout_s
        self.frame_bytes: list[int] = []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, str(rank)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
            )
            for rank in range(num_workers)
        ]
        try:
            for rank, proc in enumerate(self.procs):
                setup = dict(mode=mode, reads=(reads or [{}] * num_workers)[rank], shapes=shapes or {})
                _write_frame(proc.stdin, setup)
            for rank in range(num_workers):
                status, _ = self._receive(rank, "its start (imports, CUDA context, targets)")
                assert status == "ready"
        except BaseException:
            self.close()
            raise

    def collective_rpc(
        self, method: str | Callable, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        payload = pickle.dumps((method, args, kwargs or {}))
        self.frame_bytes.append(len(payload))
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(struct.pack("<Q", len(payload)) + payload)
            proc.stdin.flush()
        name = method if isinstance(method, str) else f"{method.__module__}.{method.__qualname__}"
        results = []
        for rank in range(len(self.procs)):
            status, value = self._receive(rank, f"collective_rpc({name})")
            if status == "error":
                raise RuntimeError(f"worker {rank} failed in {name}:\n{value}")
            results.append(value)
        return results

    def reset_prefix_cache(self) -> None:
        """``receive`` resets the engine's prefix cache after a load; there is none here."""

    def _receive(self, rank: int, what: str) -> Any:
        proc = self.procs[rank]
        assert proc.stdout is not None
        deadline = time.monotonic() + self.timeout_s
        fd = proc.stdout.fileno()

        def read(n: int) -> bytes:
            data = b""
            while len(data) < n:
                left = deadline - time.monotonic()
                ready, _, _ = select.select([fd], [], [], max(left, 0))
                if not ready:
                    raise TimeoutError(
                        f"ipc worker {rank}: no answer to {what} within {self.timeout_s:.0f} s"
                    )
                chunk = os.read(fd, n - len(data))
                if not chunk:
                    raise RuntimeError(f"ipc worker {rank} exited (code {proc.poll()}) during {what}")
                data += chunk
            return data

        (size,) = struct.unpack("<Q", read(8))
        return pickle.loads(read(size))

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    _write_frame(proc.stdin, None)
                    proc.stdin.close()
                except BrokenPipeError:
                    pass  # already gone; its exit code is checked below
        for rank, proc in enumerate(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
                raise RuntimeError(
                    f"ipc worker {rank} did not exit within 30 s of the end of its input"
                ) from None


def ipc_engine(workers: ProcessWorkers) -> Any:
    """The weight receiver of a vLLM engine on GPU whose TP workers are ``workers`` (standing in for
    vLLM's ``LLM``); everything from ``receive`` down is rltrain's code."""
    from rltrain.rollout.protocol import EngineSettings
    from rltrain.rollout.vllm.core import EngineCore
    from rltrain.rollout.vllm.options import VllmOptions
    from rltrain.rollout.vllm.receive import WeightReceiver

    settings = EngineSettings(
        tensor_model_parallel_size=len(workers.procs), options=VllmOptions(multiprocess=True)
    )
    core = EngineCore("<ipc workers>", settings, in_process=False, gpu=True)
    return WeightReceiver(core, workers, local_model=None)


def llama_tensors(
    *,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    layers: int,
    vocab: int,
    tied: bool,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random HF-named Llama weights of these sizes, in checkpoint order (fused groups adjacent)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    head_dim = hidden // heads

    def make(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    yield "model.embed_tokens.weight", make(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", make(hidden)
        yield p + "self_attn.q_proj.weight", make(heads * head_dim, hidden)
        yield p + "self_attn.k_proj.weight", make(kv_heads * head_dim, hidden)
        yield p + "self_attn.v_proj.weight", make(kv_heads * head_dim, hidden)
        yield p + "self_attn.o_proj.weight", make(hidden, heads * head_dim)
        yield p + "post_attention_layernorm.weight", make(hidden)
        yield p + "mlp.gate_proj.weight", make(intermediate, hidden)
        yield p + "mlp.up_proj.weight", make(intermediate, hidden)
        yield p + "mlp.down_proj.weight", make(hidden, intermediate)
    yield "model.norm.weight", make(hidden)
    if not tied:
        yield "lm_head.weight", make(vocab, hidden)


if __name__ == "__main__":
    worker_main(int(sys.argv[1]))
