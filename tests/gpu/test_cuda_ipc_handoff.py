"""The colocated GPU weight hand-off between processes on one device is bit-exact.

The trainer's ``ColocatedTransport.send`` drives ``VllmEngine.receive`` of an engine with two TP
workers in processes of their own (``ipc_engine``: vLLM's ``LLM`` and worker replaced, everything
else rltrain's code): each worker gets its regions as a CUDA IPC handle of a packed device buffer,
rebuilds them on its device and loads them through ``reload_weights``. Every worker reports a
SHA-256 of the part of each tensor it reads; each must equal the digest of the trainer's tensor
there. Split tensors (each worker its own half, as tensor parallelism gives them) and whole ones
(norms: one buffer shared by both workers) are mixed, in bf16 and fp32, over several buckets, twice
(new values the second time: no worker may read what an earlier sync left).
"""

from __future__ import annotations

from gpu_env import gpu_only

pytestmark = gpu_only("megatron_bridge", "safetensors")

# Which dimension tensor parallelism splits (HF layout: [out, in]); the rest every worker reads whole.
SPLIT_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1}
SPLIT_DIM.update(embed_tokens=0, lm_head=0)


def _split_dim(name: str) -> int | None:
    return SPLIT_DIM.get(name.rsplit(".", 2)[-2])


class SplitSource:
    """A ``WeightSource`` of full tensors on this process: split tensors in halves along their
    ``SPLIT_DIM`` (worker w reads half w), the others whole for every worker."""

    def __init__(self, named: list) -> None:
        self.named = named

    def reads(self, worker: int, num_workers: int) -> dict[str, list[tuple[int, int]]]:
        """``{name: [(start, stop) per dim]}``: the part ``worker`` reads of every tensor."""
        out = {}
        for name, tensor in self.named:
            box = [(0, size) for size in tensor.shape]
            dim = _split_dim(name)
            if dim is not None:
                part = tensor.shape[dim] // num_workers
                box[dim] = (worker * part, (worker + 1) * part)
            out[name] = box
        return out

    def regions(self, engine, *, dst: int = 0):
        from rltrain.weight_sync.types import TensorRegions

        for name, tensor in self.named:
            if _split_dim(name) is None:
                yield TensorRegions.whole(name, tensor, engine.tp)
                continue
            regions = {}
            for worker, box in ((w, self.reads(w, engine.tp)[name]) for w in range(engine.tp)):
                slices = tuple(slice(a, b) for a, b in box)
                regions[worker] = [(slices, tensor[slices])]
            yield TensorRegions(name, tuple(tensor.shape), regions)


def test_ipc_handoff_to_two_worker_processes_is_bit_exact() -> None:
    import torch
    from ipc_engine import ProcessWorkers, ipc_engine, llama_tensors, region_digest

    from megatron_bridge.reshard import EngineLayout
    from rltrain.weight_sync.transport import ColocatedTransport

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    sizes = dict(hidden=256, intermediate=512, heads=8, kv_heads=4, layers=3, vocab=1000, tied=False)
    named = list(llama_tensors(**sizes, dtype=torch.bfloat16, device=device))
    # Norms in fp32 (as some checkpoints keep them), of a size that is no multiple of the 16-byte
    # alignment of packed buckets; the vocabulary (1000) is no multiple of 16 rows either.
    named = [(n, t.float()[:-1] if "norm" in n else t) for n, t in named]
    payload = sum(t.numel() * t.element_size() for _, t in named)
    source = SplitSource(named)
    num_workers = 2
    workers = ProcessWorkers(
        num_workers, mode="record", reads=[source.reads(w, num_workers) for w in range(num_workers)]
    )
    try:
        engine = ipc_engine(workers)
        transport = ColocatedTransport(
            rank=0, host_ranks=[0], engine=engine, layout=EngineLayout(tp=num_workers), bucket_bytes=1 << 20
        )
        for round_ in range(2):
            if round_:
                source.named = named = [(n, t + 1) for n, t in named]  # new values, same shapes
            workers.frame_bytes.clear()
            stats = transport.send(source)
            frames = list(workers.frame_bytes)
            seen = workers.collective_rpc("take_records")
            print(f"round {round_}: {stats}; request frames {frames} bytes, payload {payload} bytes")
            assert stats is not None and stats.num_tensors == len(named) and stats.path == "reload"
            assert stats.num_buckets == len(frames) >= 3, "several buckets, one call each"
            # Only handles and metadata crossed the process boundary, never the weights.
            assert max(frames) < 64 << 10 < payload, (frames, payload)
            for worker, got in enumerate(seen):
                assert got["num_loads"] == stats.num_buckets
                records, reads = got["records"], source.reads(worker, num_workers)
                assert sorted(records) == sorted(n for n, _ in named)
                for name, tensor in named:
                    dtype, shape, on, digest = records[name]
                    assert (dtype, shape, on) == (str(tensor.dtype), tuple(tensor.shape), "cuda:0"), name
                    assert digest == region_digest(tensor, reads[name]), f"worker {worker}: {name} differs"
    finally:
        workers.close()
