"""Functions run on every rank by the Megatron distributed tests; each returns numbers to assert."""

from __future__ import annotations

from megatron_fixtures import actor_round, critic_round, max_diffs, tiny_llama, tiny_mixtral

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


def pp2_case(tmp: str) -> dict[str, dict[str, float]]:
    """PP=2 and PP=2×VPP=2 load the weights a TP=1/DP=2 run saved, then must match it."""
    hf = tiny_llama()
    batching = MicroBatching(micro_batch_size=1, use_remove_padding=True)
    ref = actor_round(hf, ParallelConfig(), batching, save_to=f"{tmp}/ref")
    pp2 = actor_round(hf, ParallelConfig(pipeline_model_parallel_size=2), batching, load_from=f"{tmp}/ref")
    vpp = actor_round(
        hf,
        ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        batching,
        load_from=f"{tmp}/ref",
    )
    return {"pp2": max_diffs(ref, pp2), "pp2_vpp2": max_diffs(ref, vpp)}


def ep2_case(tmp: str) -> dict[str, dict[str, float]]:
    """MoE (4 experts, top-2, aux loss): EP=2 loads the weights an EP=1 run saved, then must match it."""
    hf = tiny_mixtral()
    batching = MicroBatching(micro_batch_size=1, use_remove_padding=True)
    ref = actor_round(hf, ParallelConfig(), batching, save_to=f"{tmp}/ref")
    ep2 = actor_round(hf, ParallelConfig(expert_model_parallel_size=2), batching, load_from=f"{tmp}/ref")
    return {"ep2": max_diffs(ref, ep2)}
