"""``WeightReceiver``: the engine side of weight sync for both vLLM engines, the one receive path
every transport of ``rltrain.weight_sync`` ends in.

Contract:
- ``receive`` takes per HF tensor (the names of the model's HF checkpoint, unfused) the regions
  each worker reads, loads them in place, then resets the prefix cache. A CPU engine of a dense
  unquantized model loads them with ``direct_load.DirectLoader`` (the model's loaders into a reused
  scratch tensor, then vLLM's CPU repack; ``VllmOptions.weight_load``), in this process (TP=1) or
  inside each worker; everything else goes through the worker's ``reload_weights(weights_iterator=...,
  is_checkpoint_format=True)`` (raw ``model.load_weights`` fails on the CPU build, whose linear
  weights are repacked after loading). A call may carry a subset of the weights, but every fused
  module it touches must be complete (q/k/v together, gate/up together). ``load_weights`` is
  ``receive`` of whole tensors.
- ``weights_digests`` reads back the engine's effective weights (see ``checksum``).
How weights reach the workers is chosen by detection, not by the caller: an in-process engine
(the CPU default) receives the tensors themselves, streamed through one load; multi-process
workers receive group-aligned buckets of their own regions, by CUDA IPC handle on GPU or as a
serialized blob on CPU.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from megatron_bridge.vllm_names import fused_group
from rltrain.rollout.vllm import checksum, worker_fns
from rltrain.rollout.vllm.core import EngineCalls, EngineCore
from rltrain.rollout.vllm.direct_load import DirectLoader, direct_loader_for
from rltrain.rollout.vllm.reload import reload_in_place
from rltrain.weight_sync.buckets import iter_buckets
from rltrain.weight_sync.sampling import DigestRequest
from rltrain.weight_sync.types import NamedTensor, SyncStats, TensorRegions


class WeightReceiver:
    """Loads weights into one vLLM engine through ``calls`` (its ``collective_rpc``, prefix-cache
    reset and wake-up); ``local_model`` gives an in-process engine's model (None: no worker here)."""

    def __init__(
        self, core: EngineCore, calls: EngineCalls, *, local_model: Callable[[], torch.nn.Module] | None
    ) -> None:
        self.core, self.calls, self._local_model = core, calls, local_model

    @property
    def num_workers(self) -> int:
        """The engine's TP workers (what ``TensorRegions.regions`` is keyed by)."""
        return self.core.settings.tensor_model_parallel_size

    def load_weights(
        self, named_tensors: Iterable[NamedTensor], *, bucket_bytes: int = 256 << 20
    ) -> SyncStats:
        """``receive`` of whole HF tensors: every worker reads each tensor whole (vLLM narrows it)."""
        tp = self.num_workers
        return self.receive(
            (TensorRegions.whole(n, t, tp) for n, t in named_tensors), bucket_bytes=bucket_bytes
        )

    def receive(self, updates: Iterable[TensorRegions], *, bucket_bytes: int = 256 << 20) -> SyncStats:
        """Load HF tensors in place, each worker its own regions, then reset the prefix cache (a
        sleeping GPU engine gets its weight memory back first; its KV cache waits for ``wake_up``).

        The one receive path of every transport. An in-process worker (TP=1) takes the tensors
        themselves, streamed through one load; workers in processes of their own take group-aligned
        buckets of about ``bucket_bytes``, each worker one buffer with its own regions only (a CUDA
        IPC handle on GPU, a serialized blob on CPU). Every fused module a call touches must be
        complete in it. ``SyncStats.num_bytes`` counts what the workers took in, all together.
        """
        start = time.perf_counter()
        self.core.wake_weights(self.calls)
        counter = _Counter(updates)
        num_calls = 1
        direct = self.direct_loader()
        stream = ((u.name, u.full(0)) for u in counter)  # an in-process engine's one worker
        if direct is not None:
            direct.load(stream)
            path = "direct"
        elif self.core.in_process:
            reload_in_place(self.local_model(), stream, reload=self._reload_in_process)
            path = "reload"
        else:
            path, num_calls = "reload", 0
            named = ((u.name, u) for u in counter)
            for bucket in iter_buckets(named, bucket_bytes, weigh=lambda u: u.num_bytes):
                path = self._load_bucket_remote([u for _, u in bucket])
                num_calls += 1
        counter.check_complete_groups()
        self.calls.reset_prefix_cache()
        return SyncStats(counter.num_tensors, counter.num_bytes, num_calls, time.perf_counter() - start, path)

    def _reload_in_process(self, weights: Iterable[NamedTensor]) -> None:
        self.calls.collective_rpc(
            "reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True)
        )

    def direct_loader(self) -> DirectLoader | None:
        """The in-process engine's ``DirectLoader`` when ``VllmOptions.weight_load`` selects it
        (workers in other processes decide for themselves, in ``worker_fns``)."""
        mode = self.core.options.weight_load
        if not self.core.in_process or mode == "reload":
            return None
        if self.num_workers != 1:  # the other TP workers are not in this process
            if mode == "direct":
                raise ValueError(
                    "weight_load='direct' needs TP=1 in process, or workers in their own processes"
                )
            return None
        return direct_loader_for(self, self.local_model(), mode)

    def _load_bucket_remote(self, bucket: list[TensorRegions]) -> str:
        """Load one bucket, every worker its own regions; returns how worker rank 0 took it in."""
        per_worker: dict[int, list[tuple[str, tuple[int, ...], list]]] = {}
        for update in bucket:
            for worker, regions in update.regions.items():
                per_worker.setdefault(worker, []).append((update.name, update.shape, regions))
        mode = self.core.options.weight_load
        if self.core.on_gpu:
            buffers, parcels = worker_fns.share_per_worker_cuda_ipc(per_worker)
            paths = self.calls.collective_rpc(worker_fns.load_regions, args=(parcels, mode))
            torch.cuda.synchronize()
            del buffers  # the workers are done with the shared memory
        else:
            parcels = worker_fns.serialize_per_worker(per_worker)
            paths = self.calls.collective_rpc(worker_fns.load_regions, args=(parcels, mode))
        return paths[0]

    def weights_digests(self) -> dict[str, str]:
        """``{hf_name: sha256}`` of the effective weights of worker rank 0's shard."""
        return self.all_weights_digests()[0]

    def all_weights_digests(self, request: DigestRequest | None = None) -> list[dict[str, str]]:
        """Per worker (TP rank order): ``{hf_name: sha256}`` of the effective weights of its shard
        (with a ``request``: of the tensors it names, on their sampled columns)."""
        if self.core.in_process and self.num_workers == 1:  # the model is here: no engine round trip
            return [checksum.engine_digests(self.local_model(), request)]
        # plain data: vLLM's engine-core messages turn a dataclass into a dict on the way
        plain = None if request is None else dataclasses.asdict(request)
        return self.calls.collective_rpc(worker_fns.worker_digests, args=(plain,))

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The effective weights of an in-process engine by HF name (copies; for tests and debugging)."""
        if not self.core.in_process:
            raise RuntimeError("hf_weights() needs an in-process engine; use weights_digests()")
        return {name: t.clone() for name, t in checksum.engine_hf_weights(self.local_model())}

    def local_model(self) -> torch.nn.Module:
        if self._local_model is None:
            raise RuntimeError("this engine's workers run in processes of their own")
        return self._local_model()


class _Counter:
    """Wraps a weight stream: counts tensors/bytes and tracks which fused modules were completed."""

    def __init__(self, updates: Iterable[TensorRegions]) -> None:
        self._source = updates
        self.num_tensors = 0
        self.num_bytes = 0
        self.names: list[str] = []
        self._members: dict[str, set[str]] = {}

    def __iter__(self) -> Iterator[TensorRegions]:
        for update in self._source:
            self.num_tensors += 1
            self.num_bytes += update.num_bytes
            self.names.append(update.name)
            self._members.setdefault(fused_group(update.name), set()).add(update.name.rsplit(".", 2)[-2])
            yield update

    def check_complete_groups(self) -> None:
        """Raise if a fused q/k/v or gate/up module got only part of its HF tensors. In multi-latent
        attention (its ``kv_a_proj_with_mqa`` streamed) a ``q_proj`` is a module of its own
        (DeepSeek-V2-Lite's direct query projection), with no k/v beside it."""
        required = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"})
        mla = {g.rsplit(".", 1)[0] for g, m in self._members.items() if "kv_a_proj_with_mqa" in m}
        for group, members in self._members.items():
            for needed in required:
                if needed == required[0] and group.rsplit(".", 1)[0] in mla:
                    continue
                if members & needed and not needed <= members:
                    raise ValueError(
                        f"partial weight load into fused module {group!r}: got {sorted(members & needed)}, "
                        f"missing {sorted(needed - members)}; vLLM processed the module half-loaded"
                    )
