"""One rank of the broadcast-transport test: rank 0 sends perturbed weights, rank 1 holds a vLLM engine.

Usage: python broadcast_worker.py RANK PORT MODEL_DIR OUT_DIR  (launched twice by the test)."""

from __future__ import annotations

import json
import os
import sys

import torch


def perturbed_weights(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from megatron_bridge.vllm_names import grouped_order

    gen = torch.Generator().manual_seed(7)
    weights = grouped_order(load_file(os.path.join(model_dir, "model.safetensors")).items())
    return {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in weights}


def main(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    from rltrain.weight_sync import TensorSource
    from rltrain.weight_sync.broadcast import BroadcastTransport, standalone_group

    group = standalone_group(host="127.0.0.1", port=port, rank=rank, world_size=2)
    weights = perturbed_weights(model_dir)
    transport = BroadcastTransport(group=group, src_rank=0, bucket_bytes=64 << 10)
    result: dict = {}
    if rank == 0:
        stats = transport.send(TensorSource(weights))
        result = {
            "num_tensors": stats.num_tensors,
            "num_bytes": stats.num_bytes,
            "num_buckets": stats.num_buckets,
        }
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from rltrain.rollout.vllm.engine import VllmEngine
        from rltrain.rollout.protocol import EngineSettings
        from rltrain.rollout.vllm.options import VllmOptions
        from rltrain.rollout.types import SamplingConfig

        engine = VllmEngine(
            model_dir, settings=EngineSettings(max_model_len=128, options=VllmOptions(kv_cache_space_gb=0.1))
        )
        greedy = SamplingConfig(temperature=0.0, response_length=8)
        before = engine.generate([[5, 17, 42]], greedy).response_ids
        stats = transport.receive(engine)
        after = engine.generate([[5, 17, 42]], greedy).response_ids
        back = engine.hf_weights()
        result = {
            "num_tensors": stats.num_tensors,
            "num_bytes": stats.num_bytes,
            "num_buckets": stats.num_buckets,
            "greedy_changed": before != after,
            "mismatched": [n for n, t in weights.items() if not torch.equal(back[n], t)],
        }
        engine.shutdown()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
