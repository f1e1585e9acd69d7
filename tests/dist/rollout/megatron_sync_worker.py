"""One rank of the Megatron (TP=2, gloo) → vLLM weight-sync test.

Usage: RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set;
python megatron_sync_worker.py ENGINE_DIR ACTOR_DIR OUT LAYOUT   (LAYOUT: a key of ``LAYOUTS``; those
ending in ``engine_tp2`` sync into one engine at TP=2, the others into a TP=1 engine on each rank).
The engine starts from ENGINE_DIR's weights, the actor from ACTOR_DIR's (a different seed), so the
first sync has to move every weight. Each rank hosts an in-process engine (vLLM builds its groups
collectively over the default group, so every rank must start one); the sync streams the actor's
HF-named weights into each engine in turn through the policy worker's own ``WeightSender`` (planned
export, colocated transport, ``VllmEngine.receive``); the checksums compare against the bridge's
full export. Rank 0 writes the numbers."""

from __future__ import annotations

import json
import math
import sys

import torch
import torch.distributed as dist

PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 3, 150], [11, 12, 13, 14, 15, 16]]
LONG_PROMPTS = [list(range(30, 54)), list(range(100, 120)), [7, 9] * 11]
"""``long``: 20-24 prompt tokens and 24 response tokens, rows reaching past position 40 (the YaRN tests'
original_max_position_embeddings is 16)."""


def token_batch(out, response_length: int, pad_id: int):
    from rltrain.algo.token_batch import TokenBatch

    prompt_len = max(len(p) for p in out.prompt_ids)
    rows = torch.full((out.num_samples, prompt_len + response_length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(rows)
    for s, ids in enumerate(out.response_ids):
        prompt = out.sample_prompt_ids(s)
        rows[s, prompt_len - len(prompt) : prompt_len] = torch.tensor(prompt)
        rows[s, prompt_len : prompt_len + len(ids)] = torch.tensor(ids)
        mask[s, prompt_len - len(prompt) : prompt_len + len(ids)] = 1
    return TokenBatch(input_ids=rows, attention_mask=mask, response_len=response_length)


LAYOUTS = {
    "tp2": {"tensor_model_parallel_size": 2},
    "ep2": {"expert_model_parallel_size": 2},
    "tp2_engine_tp2": {"tensor_model_parallel_size": 2},
    # MoE at TP=2 needs sequence parallelism; the experts take expert-TP 2 (Megatron's default: TP)
    "moe_tp2_engine_tp2": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "tp2_ep2_etp1": {
        "tensor_model_parallel_size": 2,
        "sequence_parallel": True,
        "expert_model_parallel_size": 2,
        "expert_tensor_parallel_size": 1,
    },
    "tp2_ep2_etp1_engine_tp2": {
        "tensor_model_parallel_size": 2,
        "sequence_parallel": True,
        "expert_model_parallel_size": 2,
        "expert_tensor_parallel_size": 1,
    },
}


def syncs_until_planted(sender, engine, name: str, *, worker: int) -> dict:
    """The product's default verification (sampled) over real syncs: they pass, until a wrong value is
    planted in engine worker ``worker``'s regions of ``name`` (on trainer rank 0's engine), at one of
    the columns the first sync that samples ``name`` after sync 0 checks; that sync must stop."""
    from rltrain.errors import WeightSyncMismatchError
    from rltrain.logging import metrics as m
    from rltrain.weight_sync.sampling import ModuleRotation, sample_columns

    every = sender.check.every
    rotation = ModuleRotation()  # the product's: a tensor's module, numbered in export order
    position = {n: rotation.position(n) for n in sender.source.shapes}[name]
    target = next(k for k in range(1, every + 1) if k % every == position % every)
    sender.check.num_syncs = 0  # the earlier syncs of this test went around the sender
    verified = []
    for _ in range(target):
        metrics = sender.sync()
        verified.append(
            (metrics.get(m.WEIGHT_SYNC_CHECKSUM_MISMATCHES), metrics.get(m.WEIGHT_SYNC_VERIFIED_TENSORS))
        )
    planted_at = None
    if engine is not None and sender.rank == 0:
        real_receive = engine.receive

        def plant(update):
            nonlocal planted_at
            if update.name != name:
                return update
            regions = update.regions[worker]
            lo = min(s[-1].start for s, _ in regions)
            width = max(s[-1].stop for s, _ in regions) - lo
            slices, values = regions[0]
            column = next(
                c for c in sample_columns(name, target, width) if slices[-1].start <= c + lo < slices[-1].stop
            )
            wrong = values.clone()
            wrong[0, column + lo - slices[-1].start] += 1.0
            update.regions = {**update.regions, worker: [(slices, wrong), *regions[1:]]}
            planted_at = column
            return update

        engine.receive = lambda updates, **kw: real_receive((plant(u) for u in updates), **kw)
    try:
        sender.sync()
        stopped = None
    except WeightSyncMismatchError as e:
        stopped = str(e)
    finally:
        if engine is not None and sender.rank == 0:
            del engine.receive  # the class's own again
    return {
        "every": every,
        "verified": verified,
        "target_sync": target,
        "planted_column": planted_at,
        "stopped": stopped,
    }


def main(engine_dir: str, actor_dir: str, out_path: str, layout: str, length: str = "short") -> None:
    from transformers import AutoTokenizer

    from megatron_bridge.hf_config import load_hf_config
    from megatron_bridge.hf_io import HFCheckpointReader
    from megatron_bridge.live import bridge_for_chunks, export_hf_weights, load_hf_weights
    from megatron_bridge.reshard import EngineLayout
    from rltrain.config.optim import OptimConfig
    from rltrain.config.parallel import ParallelConfig
    from rltrain.config.rollout import WeightSyncConfig
    from rltrain.megatron.parallel import ParallelContext
    from rltrain.megatron.worker import MegatronWorker
    from rltrain.rollout.vllm.engine import VllmEngine
    from rltrain.rollout.mismatch import logprob_mismatch
    from rltrain.rollout.protocol import EngineSettings
    from rltrain.rollout.vllm.options import VllmOptions
    from rltrain.rollout.types import SamplingConfig
    from rltrain.weight_sync import PlannedExport, build_sender, checksum

    ctx = ParallelContext.initialize(ParallelConfig(**LAYOUTS[layout]))
    hf_config = load_hf_config(actor_dir)  # Kimi-K2's kimi_k2 reads as DeepseekV3Config
    actor = MegatronWorker(
        hf_config, ctx=ctx, role="actor", optim=OptimConfig(lr=3e-3), params_dtype=torch.float32
    )
    bridge = bridge_for_chunks(hf_config, actor.chunks, ctx)
    load_hf_weights(actor.chunks, ctx, bridge, HFCheckpointReader(actor_dir))
    engine_tp = 2 if layout.endswith("engine_tp2") else 1
    engine_ranks = list(range(ctx.world_size)) if engine_tp == 1 else [0]
    max_model_len = min(128, hf_config.max_position_embeddings)
    settings = EngineSettings(
        max_model_len=max_model_len,
        tensor_model_parallel_size=engine_tp,
        options=VllmOptions(kv_cache_space_gb=0.1),
    )
    engine = VllmEngine(engine_dir, settings=settings) if ctx.rank in engine_ranks else None
    prompts = LONG_PROMPTS if length == "long" else PROMPTS
    sampling = SamplingConfig(
        temperature=1.0,
        n=2,
        response_length=24 if length == "long" else 12,
        seed=11,
        ignore_eos=length == "long",
    )
    pad_id = AutoTokenizer.from_pretrained(engine_dir).pad_token_id

    planned = PlannedExport(actor.chunks, ctx, bridge)
    sender = build_sender(
        planned,
        sync_config=WeightSyncConfig(bucket_size_mb=1),
        mode="colocated",
        rank=ctx.rank,
        host_ranks=engine_ranks,
        engine_tp=engine_tp,
        engine=engine,
    )

    def sync() -> dict:  # as PolicyWorker.sync_weights
        stats = sender.transport.send(planned)
        if stats is None:  # a rank without an engine
            return {}
        return {"num_tensors": stats.num_tensors, "num_bytes": stats.num_bytes, "seconds": stats.seconds}

    def rollout_and_compare(tag: str) -> dict:
        box = [engine.generate(prompts, sampling) if ctx.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        out = box[0]
        batch = token_batch(out, sampling.response_length, pad_id)
        trainer = actor.compute_log_prob(batch).logprobs
        _, rollout, mask = out.padded(pad_token_id=pad_id)
        rollout = torch.nn.functional.pad(rollout, (0, sampling.response_length - rollout.shape[1]))
        mask = torch.nn.functional.pad(mask, (0, sampling.response_length - mask.shape[1]))
        return {
            "tag": tag,
            **logprob_mismatch(trainer, rollout, mask, prefix=""),
            "batch": batch,
            "trainer": trainer,
        }

    before = rollout_and_compare("before_sync")
    first = {**sync(), **rollout_and_compare("after_first_sync")}
    # The CPU experts' prepacked layout is read back for GPT-OSS's stacked experts only (a known
    # permutation); other MoE models are checked by logprobs.
    readable = not bridge.dims.num_experts or hf_config.model_type == "gpt_oss"
    problems = None
    if readable and engine_tp == 1:
        expected = checksum.digests(export_hf_weights(actor.chunks, ctx, bridge, dst=0))
        problems = checksum.compare_digests(expected, engine.weights_digests()) if ctx.rank == 0 else []
    if readable and engine_tp == 2:  # each engine worker against its own shard, as vLLM narrows it
        problems, per_worker = [], engine.all_weights_digests() if engine is not None else [None] * 2
        shards = [(u.name, u) for u in planned.regions(EngineLayout(tp=2), dst=0)]
        for worker, engine_digests in enumerate(per_worker):
            # vLLM's GPT-OSS loader zeroes the down bias on TP ranks but 0 (added once after the
            # all-reduce): nothing of the trainer's there, so those workers do not report it
            zeroed = {n for n in planned.shapes if n.endswith("experts.down_proj_bias") and worker}
            expected = checksum.digests(
                (n, u.shard(worker)) for n, u in shards if worker in u.regions and n not in zeroed
            )
            if ctx.rank == 0:
                problems += [
                    f"worker {worker}: {p}" for p in checksum.compare_digests(expected, engine_digests)
                ]
                if set(engine_digests) != set(planned.shapes) - zeroed:
                    problems.append(f"worker {worker}: reported {len(engine_digests)} tensors")
        problems += sender.verify()  # the product's own check agrees

    def loss_fn(output, mb):
        mask = mb.response_mask.float()
        return -(output.logprobs * mask).sum() / first["batch"].response_mask.sum(), {}

    # multi-token-prediction layers (training ignores them): frozen, and exported as loaded
    mtp_before = {n: p.detach().clone() for c in actor.chunks for n, p in c.named_parameters() if "mtp." in n}
    step = actor.update(first["batch"], loss_fn)
    mtp_after = {n: p for c in actor.chunks for n, p in c.named_parameters() if "mtp." in n}
    mtp_change = max([(mtp_after[n] - p).abs().max().item() for n, p in mtp_before.items()], default=0.0)
    exported = dict(export_hf_weights(actor.chunks, ctx, bridge, dst=0)) if bridge.num_mtp_layers else {}
    mtp = f"model.layers.{bridge.dims.num_layers}."
    mtp_exported = {n: t for n, t in exported.items() if n.startswith(mtp)}
    # the MTP layer's copies of the main embedding and head that the checkpoint stores (GLM-4.5: no head)
    copies = {mtp + "embed_tokens.weight": "model.embed_tokens.weight"}
    copies[mtp + "shared_head.head.weight"] = "lm_head.weight"
    copies = {copy: main for copy, main in copies.items() if copy in mtp_exported}
    moved = actor.compute_log_prob(first["batch"]).logprobs
    second = {**sync(), **rollout_and_compare("after_step_and_sync")}
    planted = None
    if layout in ("tp2", "tp2_engine_tp2"):
        planted = syncs_until_planted(
            sender, engine, "model.layers.0.mlp.down_proj.weight", worker=engine_tp - 1
        )
    if ctx.rank == 0:
        mask = first["batch"].response_mask.bool()
        itemsize = 4  # fp32
        per_rank = {
            r: sum(math.prod(sl.stop - sl.start for sl in c.dst) * itemsize for c in copies)
            for r, copies in planned.plan(EngineLayout(tp=engine_tp)).items()
        }
        result = {
            "planned_bytes": per_rank,
            "full_bytes": sum(math.prod(shape) * itemsize for shape in planned.shapes.values()),
            "runs": [
                {k: v for k, v in r.items() if k not in ("batch", "trainer")} for r in (before, first, second)
            ],
            "checksum_problems": problems,
            "planted": planted,
            "step_skipped": bool(step.skipped),
            "step_logprob_change": float((moved - first["trainer"])[mask].abs().max()),
            "mtp": {}
            if not bridge.num_mtp_layers
            else {
                "num_params": len(mtp_before),
                "trainable": sum(p.requires_grad for p in mtp_after.values()),
                "max_change_after_step": mtp_change,
                "exported": len(mtp_exported),
                "exported_as_loaded": all(
                    torch.equal(t, HFCheckpointReader(actor_dir).get(n))
                    for n, t in mtp_exported.items()
                    if n not in copies
                ),
                # the MTP layer's embedding and head are the main model's (trained) ones
                "copies_are_the_main_tensors": all(
                    torch.equal(mtp_exported[copy], exported[main]) for copy, main in copies.items()
                ),
                "main_head_trained": not torch.equal(
                    exported["lm_head.weight"], HFCheckpointReader(actor_dir).get("lm_head.weight")
                ),
            },
        }
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    if engine is not None:
        engine.shutdown()
    ctx.destroy()


if __name__ == "__main__":
    main(*sys.argv[1:6])
