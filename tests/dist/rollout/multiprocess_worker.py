"""A multi-process vLLM engine (workers in their own process) taking bucketed loads as serialized
blobs through ``collective_rpc``, the CPU stand-in for the GPU CUDA-IPC path. Runs in its own
process: vLLM's teardown clears process-wide parallel state an in-process engine still needs.

Usage: python multiprocess_worker.py MODEL_DIR OUT_JSON"""

from __future__ import annotations

import json
import os
import sys

import torch


def main(model_dir: str, out_path: str) -> None:
    from safetensors.torch import load_file

    from megatron_bridge.vllm_names import grouped_order
    from rltrain.rollout.vllm.engine import VllmEngine
    from rltrain.rollout.protocol import EngineSettings
    from rltrain.rollout.vllm.options import VllmOptions
    from rltrain.rollout.types import SamplingConfig
    from rltrain.weight_sync import checksum

    weights = grouped_order(load_file(os.path.join(model_dir, "model.safetensors")).items())
    gen = torch.Generator().manual_seed(3)
    new = [(n, t + 0.05 * torch.randn(t.shape, generator=gen)) for n, t in weights]
    settings = EngineSettings(
        max_model_len=128, options=VllmOptions(kv_cache_space_gb=0.1, multiprocess=True)
    )
    engine = VllmEngine(model_dir, settings=settings)
    greedy = SamplingConfig(temperature=0.0, response_length=8)
    before = engine.generate([[5, 17, 42]], greedy)
    stats = engine.load_weights(new, bucket_bytes=64 << 10)
    problems = checksum.compare_digests(checksum.digests(new), engine.weights_digests())
    changed = engine.generate([[5, 17, 42]], greedy).response_ids != before.response_ids
    engine.load_weights(weights, bucket_bytes=64 << 10)
    after = engine.generate([[5, 17, 42]], greedy)
    result = {
        "in_process": engine.in_process,
        "num_tensors": stats.num_tensors,
        "load_path": stats.path,
        "digest_problems": problems,
        "greedy_changed": changed,
        "restored_bit_identical": after.response_ids == before.response_ids
        and after.response_logprobs == before.response_logprobs,
    }
    engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
