"""Functions run on every rank by the Megatron distributed tests; each returns numbers to assert."""

from __future__ import annotations

from megatron_fixtures import actor_round, critic_round, max_diffs, tiny_llama

from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.forward import MicroBatching


def tp2_case() -> dict[str, dict[str, float]]:
    hf = tiny_llama()
    batching = MicroBatching(micro_batch_size=1, use_remove_padding=True)
    diffs = {}
    ref = actor_round(hf, ParallelConfig(tensor_model_parallel_size=1), batching)
    tp2 = actor_round(hf, ParallelConfig(tensor_model_parallel_size=2), batching)
    diffs["actor"] = max_diffs(ref, tp2)
    ref = critic_round(hf, ParallelConfig(tensor_model_parallel_size=1), batching)
    tp2 = critic_round(hf, ParallelConfig(tensor_model_parallel_size=2), batching)
    diffs["critic"] = max_diffs(ref, tp2)
    diffs["sanity"] = {"loss_changed": float((ref["values"] - ref["values_after"]).abs().max())}
    return diffs
