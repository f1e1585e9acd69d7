"""One rank of the planner-driven export test (no vLLM: the reference is the bridge's full export).

Usage: RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set;
python planned_export_worker.py MODEL_DIR OUT LAYOUT   (LAYOUT: tp2 | tp2_ep2 | pp2 | pp2_1+2 | ep2 | cp2).
The trainer model loads MODEL_DIR's HF weights at LAYOUT. For every destination rank, the planned
stream of an engine at TP=1 must equal ``export_hf_weights`` (names, order, bits). For an engine at
TP=2 (for MoE: with EP=2, "tp2", and with TP-split experts, "tp2_ep1") every region each engine
rank receives must equal that region of the full tensors, and the bytes it receives are counted against the full export's; the full export is compared
with MODEL_DIR's tensors bit for bit. Rank 0 writes the numbers.
"""

from __future__ import annotations

import json
import sys

import torch

LAYOUTS = {
    "tp2": {"tensor_model_parallel_size": 2},
    "pp2": {"pipeline_model_parallel_size": 2},
    # uneven stages (3-layer model): 1 layer on the first stage, 2 on the last
    "pp2_1+2": {
        "pipeline_model_parallel_size": 2,
        "num_layers_in_first_pipeline_stage": 1,
        "num_layers_in_last_pipeline_stage": 2,
    },
    "ep2": {"expert_model_parallel_size": 2},
    # GPT-OSS: TP=2 for the dense layers over EP=2 with expert-TP 1 (its biased experts need it)
    "tp2_ep2": {
        "tensor_model_parallel_size": 2,
        "expert_model_parallel_size": 2,
        "expert_tensor_parallel_size": 1,
    },
    "cp2": {"context_parallel_size": 2},
}


def region_bytes(copies) -> int:
    total = 0
    for c in copies:
        n = 1
        for s in c.dst:
            n *= s.stop - s.start
        total += n * 4
    return total


def main(model_dir: str, out_path: str, layout: str) -> None:
    from transformers import AutoConfig

    from megatron_bridge.hf_io import HFCheckpointReader
    from megatron_bridge.live import bridge_for_chunks, export_hf_weights, load_hf_weights
    from megatron_bridge.reshard import EngineLayout
    from megatron_bridge.vllm_names import grouped_order
    from rltrain.config.parallel import ParallelConfig
    from rltrain.convert.model import build_padded_model
    from rltrain.megatron.parallel import ParallelContext
    from rltrain.weight_sync import PlannedExport

    ctx = ParallelContext.initialize(ParallelConfig(**LAYOUTS[layout]))
    hf_config = AutoConfig.from_pretrained(model_dir)
    chunks = build_padded_model(hf_config, ctx)
    bridge = bridge_for_chunks(hf_config, chunks, ctx)
    load_hf_weights(chunks, ctx, bridge, HFCheckpointReader(model_dir))
    planned = PlannedExport(chunks, ctx, bridge)
    bridge = bridge.main_model()  # what an engine is sent: without multi-token-prediction layers
    result: dict = {"tp2": {}}
    for dst in range(ctx.world_size):
        # the stream keeps vLLM's fused modules together (DeepSeek's q_a/kv_a); otherwise HF order
        full = grouped_order(export_hf_weights(chunks, ctx, bridge, dst=dst))
        ours = list(planned.stream(EngineLayout(tp=1), 0, dst=dst))
        if ctx.rank == dst:
            assert [n for n, _ in ours] == [n for n, _ in full], "names or order differ"
            differ = [n for (n, a), (_, b) in zip(ours, full) if not torch.equal(a, b)]
            assert not differ, f"rank {dst}: planned TP=1 stream differs from the full export: {differ}"
            result["num_tensors"] = len(full)
    full = dict(export_hf_weights(chunks, ctx, bridge, dst=0))
    if ctx.rank == 0:
        reader = HFCheckpointReader(model_dir)
        result["bit_exact_vs_checkpoint"] = sum(
            torch.equal(full[n], reader.get(n)) for n in reader.names() if n in full
        )
        result["not_sent"] = sorted(set(reader.names()) - set(full))
    engines = {"tp2": EngineLayout(tp=2, ep=2 if bridge.dims.num_experts else 1)}
    if bridge.dims.num_experts:
        engines["tp2_ep1"] = EngineLayout(tp=2)
    for key, engine in engines.items():
        plan = planned.plan(engine)
        result.setdefault(key, {})
        for engine_rank in range(engine.tp):
            got = dict(planned.stream(engine, engine_rank, dst=0))
            if ctx.rank != 0:
                continue
            for c in plan[engine_rank]:
                assert torch.equal(got[c.hf_name][c.dst], full[c.hf_name][c.dst]), (engine_rank, c)
            result[key][engine_rank] = {"num_tensors": len(got), "bytes": region_bytes(plan[engine_rank])}
    if ctx.rank == 0:
        result["full_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    torch.distributed.barrier()
    ctx.destroy()


if __name__ == "__main__":
    main(*sys.argv[1:4])
