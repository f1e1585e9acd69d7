"""The trainer side of live weight sync: the actor's Megatron shards into the rollout engines, no disk.

Layers (a sync reads top to bottom):
- ``megatron_bridge.reshard`` (pure, beside the mapping tables): which slice of which trainer shard
  each engine rank needs, under vLLM's (HF) names.
- ``export.PlannedExport``: executes that plan on the trainer's ranks; every planned slice is sent
  once, point-to-point, by the rank that owns it (collective over the trainer's ranks).
- ``transport``: how the slices reach the engines, one small interface chosen by
  ``rollout.weight_sync.transport`` in ``make_transport``: ``ColocatedTransport`` (engines in the
  trainer's processes and devices; CUDA IPC to GPU workers in other processes) and
  ``broadcast.BroadcastTransport`` (buckets over a process group to engines on other devices).
  One send path and one receive path per transport.
- ``sender.WeightSender``: one sync on one trainer rank (metrics, optional checksums of what each
  engine worker holds against its planned shard).
- ``buckets``: fused-module-aligned buckets and reused flat buffers; ``types``: the data crossing
  to the engine (``TensorRegions``, ``SyncStats``) and the engine-side protocol, whose
  implementation is ``rltrain.rollout.vllm.receive.WeightReceiver.receive`` (direct load, ``reload_weights``,
  checksums of what the engine holds).
No vLLM, no Megatron, no Ray here: torch and torch.distributed only.
"""

from rltrain.weight_sync.export import PlannedExport
from rltrain.weight_sync.sender import WeightSender, build_sender
from rltrain.weight_sync.transport import ColocatedTransport, WeightTransport, make_transport
from rltrain.weight_sync.types import SyncStats, TensorRegions, TensorSource

__all__ = [
    "ColocatedTransport",
    "PlannedExport",
    "SyncStats",
    "TensorRegions",
    "TensorSource",
    "WeightSender",
    "WeightTransport",
    "build_sender",
    "make_transport",
]
