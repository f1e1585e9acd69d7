"""The multi-process engine path: workers in their own process receive group-aligned buckets as
serialized blobs through ``collective_rpc`` (the CPU stand-in for the GPU CUDA-IPC path). Slow: a
multi-process engine starts in 35–50 s here, so it is not shared with the in-process fixture."""

from __future__ import annotations

import pytest
import torch

from rltrain.rollout import checksum
from rltrain.rollout.bucketing import grouped_order
from rltrain.rollout.types import EngineSettings, SamplingConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_multiprocess_bucketed_load_digests_and_restore(tiny_llama_dir, tiny_llama_weights):
    from rltrain.rollout.engine import RolloutEngine

    engine = RolloutEngine(
        str(tiny_llama_dir),
        settings=EngineSettings(max_model_len=128, kv_cache_space_gb=0.1, multiprocess=True),
    )
    try:
        assert not engine.in_process
        gen = torch.Generator().manual_seed(3)
        new = {
            n: t + 0.05 * torch.randn(t.shape, generator=gen)
            for n, t in grouped_order(tiny_llama_weights.items())
        }
        greedy = SamplingConfig(temperature=0.0, response_length=8)
        before = engine.generate([[5, 17, 42]], greedy)
        stats = engine.load_weights(new.items(), bucket_bytes=64 << 10)
        assert stats.num_tensors == 21
        assert checksum.compare_digests(checksum.digests(new.items()), engine.weights_digests()) == []
        assert engine.generate([[5, 17, 42]], greedy).response_ids != before.response_ids
        engine.load_weights(grouped_order(tiny_llama_weights.items()), bucket_bytes=64 << 10)
        after = engine.generate([[5, 17, 42]], greedy)
        assert (
            after.response_ids == before.response_ids and after.response_logprobs == before.response_logprobs
        )
    finally:
        engine.shutdown()
