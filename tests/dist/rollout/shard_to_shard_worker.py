"""One member of the shard-to-shard sync test: a Megatron trainer rank (gloo) or a separate vLLM
engine at TP=2 (its two CPU workers in processes of their own).

Usage: python shard_to_shard_worker.py trainer LAYOUT NUM_ENGINES WEIGHTS_PORT ACTOR_DIR OUT
          (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set: the trainer's own group)
       python shard_to_shard_worker.py engine INDEX NUM_TRAINER NUM_ENGINES WEIGHTS_PORT ENGINE_DIR OUT

The trainer ranks sync the actor (ACTOR_DIR's weights) into the engines (ENGINE_DIR's, another
seed) through the product's sender (``build_sender``, ``rollout.mode: separate``, the default
transport), then stream the colocated path's planned regions for an engine of TP=2 to rank 0
(``PlannedExport.regions``) as the reference. Each trainer rank reports what it sent and the
largest its buffers grew; rank 0 also the simulator's bytes for each trainer GPU
(``megatron_bridge.sync_plan.shard_to_shard``) and the reference digests. An engine reports the
digests of the regions it was handed per worker, its workers' effective weights read back, its
buffer peak and greedy tokens before and after; then it takes a second sync checked as a separate
engine checks itself (``weight_sync.verify``), the last engine with a wrong value planted in one
worker's region of ``PLANTED``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

LAYOUTS = {
    "tp2_pp2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    "ep2": {"expert_model_parallel_size": 2},
}
BUCKET_BYTES = 64 << 10  # small: many buckets, so receives overlap loads
PLANTED = "model.layers.0.self_attn.o_proj.weight"
"""Split on its input (last) dimension: engine worker 1's half comes from trainer TP rank 1."""


def trainer(layout: str, num_engines: int, port: int, actor_dir: str, out: str) -> None:
    from megatron_bridge import sync_plan
    from megatron_bridge.hf_config import load_hf_config
    from megatron_bridge.hf_io import HFCheckpointReader
    from megatron_bridge.live import bridge_for_chunks, load_hf_weights
    from megatron_bridge.reshard import EngineLayout
    from rltrain.config.optim import OptimConfig
    from rltrain.config.parallel import ParallelConfig
    from rltrain.config.rollout import WeightSyncConfig
    from rltrain.megatron.parallel import ParallelContext
    from rltrain.megatron.worker import MegatronWorker
    from rltrain.weight_sync import PlannedExport, build_sender, checksum
    from rltrain.weight_sync.broadcast import join_broadcast_group

    ctx = ParallelContext.initialize(ParallelConfig(**LAYOUTS[layout]))
    hf_config = load_hf_config(actor_dir)
    actor = MegatronWorker(
        hf_config, ctx=ctx, role="actor", optim=OptimConfig(lr=1e-3), params_dtype=torch.float32
    )
    bridge = bridge_for_chunks(hf_config, actor.chunks, ctx)
    load_hf_weights(actor.chunks, ctx, bridge, HFCheckpointReader(actor_dir))
    planned = PlannedExport(actor.chunks, ctx, bridge)
    group, device = join_broadcast_group(
        ("127.0.0.1", port), group_rank=ctx.rank, world_size=ctx.world_size + num_engines, timeout_s=300
    )
    sender = build_sender(
        planned,
        sync_config=WeightSyncConfig(bucket_size_mb=1),
        mode="separate",
        rank=ctx.rank,
        host_ranks=[],
        engine_tp=2,
        group=group,
        device=device,
        num_engines=num_engines,
    )
    sender.transport.bucket_bytes = BUCKET_BYTES
    metrics = sender.sync(0)
    sender.sync(1)  # the second sync, in which the last engine finds a planted wrong slice
    schedule = planned.schedule(EngineLayout(tp=2), bucket_bytes=BUCKET_BYTES)
    mine = {
        "rank": ctx.rank,
        "sent_bytes": sender.transport.last_sent_bytes,
        # relay (the default): one copy, to engine 0; direct: one per engine
        "scheduled_bytes": schedule.sent_bytes(ctx.rank) * (num_engines if sender.transport.fanout == "direct" else 1),
        "peak_extra_bytes": sender.transport.peak_extra_bytes,
        "extra_bound": schedule.extra_bytes("trainer", ctx.rank),
    }
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    reference: dict[str, dict[str, str]] = {"0": {}, "1": {}}
    for update in planned.regions(EngineLayout(tp=2), dst=0):  # the colocated path's regions
        for worker in update.regions:
            reference[str(worker)] |= checksum.digests([(update.name, update.shard(worker))])
    if ctx.rank == 0:
        place = sync_plan.Placement(
            trainer=planned.trainer,
            trainer_dp=ctx.world_size // (ctx.tp_size * ctx.pp_size),
            engine=EngineLayout(tp=2),
            engine_replicas=num_engines,
            dtype_bytes=4,
        )
        # what the transport runs, with its default fan-out (relay: the owners send to engine 0)
        simulated = sync_plan.shard_to_engine(list(planned.layouts.values()), place, fanout="relay")
        sent_by_gpu = {g: sum(t.sent.values()) for g, t in simulated.phases[0].gpus.items()}
        result = {
            "metrics": metrics,
            "ranks": everyone,
            "simulated_sent": [sent_by_gpu.get(r, 0) for r in range(ctx.world_size)],
            "reference": reference,
            "num_buckets": len(schedule.buckets),
        }
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    ctx.destroy()


def engine(index: int, num_trainer: int, num_engines: int, port: int, engine_dir: str, out: str) -> None:
    from rltrain.rollout.protocol import EngineSettings
    from rltrain.rollout.types import SamplingConfig
    from rltrain.rollout.vllm.engine import VllmEngine
    from rltrain.rollout.vllm.options import VllmOptions
    from rltrain.weight_sync import checksum
    from rltrain.weight_sync.broadcast import join_broadcast_group
    from rltrain.weight_sync.sampling import DigestRequest
    from rltrain.weight_sync.shard_to_shard import ShardToShardReceiver
    from rltrain.weight_sync.verify import EngineCheck, TappedEngine

    settings = EngineSettings(
        max_model_len=128, tensor_model_parallel_size=2, options=VllmOptions(kv_cache_space_gb=0.1)
    )
    vllm = VllmEngine(engine_dir, settings=settings)
    greedy = SamplingConfig(temperature=0.0, response_length=8)
    before = vllm.generate([[5, 17, 42]], greedy).response_ids
    group, device = join_broadcast_group(
        ("127.0.0.1", port),
        group_rank=num_trainer + index,
        world_size=num_trainer + num_engines,
        timeout_s=300,
    )
    receiver = ShardToShardReceiver(group=group, bucket_bytes=BUCKET_BYTES, device=device)
    handed: dict[str, dict[str, str]] = {"0": {}, "1": {}}
    real_receive = vllm.receive

    def tapped(updates):
        for update in updates:
            for worker in update.regions:
                handed[str(worker)] |= checksum.digests([(update.name, update.shard(worker))])
            yield update

    vllm.receive = lambda updates, **kw: real_receive(tapped(updates), **kw)
    stats = receiver.receive(vllm)
    after = vllm.generate([[5, 17, 42]], greedy).response_ids
    # every tensor whole; fused MoE experts, which a CPU engine cannot read back, skipped
    read_back = vllm.all_weights_digests(
        DigestRequest(0, dict.fromkeys(handed["0"], False), skip_unsupported=True)
    )
    # the second sync, checked as a separate engine checks itself: the last engine is handed
    # a wrong value in worker 1's region of o_proj, which the check must name with its sender
    check = EngineCheck(verify="sampled", every=32, dtype=None, where=f"separate engine {index}")
    digester = check.digester(1)  # the check's first sync: every tensor whole (fused MoE skipped)
    plant = index == num_engines - 1

    def planting(updates):
        for update in updates:
            if plant and update.name == PLANTED:
                (slices, values), *rest = update.regions[1]
                wrong = values.clone()
                wrong.view(-1)[0] += 1.0
                update.regions = {**update.regions, 1: [(slices, wrong), *rest]}
            yield update

    vllm.receive = lambda updates, **kw: real_receive(planting(updates), **kw)
    receiver.receive(TappedEngine(vllm, digester))
    problems, num_verified = check.compare(vllm, digester)
    result = {
        "handed": handed,
        "read_back": read_back,
        "num_buckets": stats.num_buckets,
        "num_bytes": stats.num_bytes,
        "peak_extra_bytes": receiver.peak_extra_bytes,
        "extra_bound": receiver.schedule.extra_bytes("engine"),
        "greedy_changed": before != after,
        "second_sync": {"problems": problems, "verified": num_verified, "planted": plant},
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    vllm.shutdown()


if __name__ == "__main__":
    role, args = sys.argv[1], sys.argv[2:]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if role == "trainer":
        trainer(args[0], int(args[1]), int(args[2]), args[3], args[4])
    else:
        engine(int(args[0]), int(args[1]), int(args[2]), int(args[3]), args[4], args[5])
