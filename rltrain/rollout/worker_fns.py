"""Functions that run inside vLLM workers through ``LLM.collective_rpc`` (first argument: the worker).

Used when the workers live in other processes (GPU engines, or ``EngineSettings.multiprocess`` on
CPU). Each call loads one group-aligned bucket (see ``bucketing``) through the worker's
``reload_weights(..., is_checkpoint_format=True)``:
- CPU: the bucket travels as a safetensors blob (tensors given as plain RPC arguments arrive as
  lists; functions need ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, set by the engine).
- GPU (colocated): the trainer packs the bucket into one device buffer and sends its CUDA IPC handle;
  every worker maps the same memory on its own device, no copy through the host.
"""

from __future__ import annotations

from typing import Any

import torch

from rltrain.rollout.bucketing import NamedTensor, PackedBucket, TensorMeta, pack_bucket, unpack_bucket


def serialize_bucket(bucket: list[NamedTensor]) -> bytes:
    """A safetensors blob of ``bucket`` (host copies of the tensors)."""
    from safetensors.torch import save

    return save({name: tensor.detach().cpu().contiguous() for name, tensor in bucket})


def reload_from_blob(worker: Any, blob: bytes) -> None:
    """Worker side of ``serialize_bucket``: load the blob's tensors in place."""
    from safetensors.torch import load

    tensors = load(blob)
    worker.reload_weights(weights_iterator=list(tensors.items()), is_checkpoint_format=True)


def share_bucket_cuda_ipc(bucket: list[NamedTensor]) -> tuple[PackedBucket, tuple[Any, tuple]]:
    """Pack ``bucket`` on the current CUDA device; return ``(packed, ipc_handle)``.

    The caller keeps ``packed`` alive until the workers returned (the handle does not own the memory).
    """
    from torch.multiprocessing.reductions import reduce_tensor

    packed = pack_bucket(bucket, device=torch.device("cuda", torch.cuda.current_device()))
    return packed, reduce_tensor(packed.flat)


def reload_from_cuda_ipc(worker: Any, handle: tuple[Any, tuple], metas: list[TensorMeta]) -> None:
    """Worker side of ``share_bucket_cuda_ipc``: map the buffer on this worker's device and load it."""
    rebuild, args = handle
    args = list(args)
    args[6] = torch.cuda.current_device()  # storage_device of rebuild_cuda_tensor: this worker's GPU
    flat = rebuild(*args)
    tensors = unpack_bucket(PackedBucket(metas, flat))
    worker.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)
    torch.cuda.synchronize()


def worker_digests(worker: Any) -> dict[str, str]:
    """``{hf_name: sha256}`` of this worker's effective weights."""
    from rltrain.rollout.checksum import engine_digests

    return engine_digests(worker.model_runner.get_model())
