"""Sync-plan simulator: the real reshard plans of released models at full size, placed on H100 nodes,
with a predicted sync time, against the lower bound and the peers' published seconds; and a
calibration of the time model on this machine.

    python bench/sync_plan_sim.py [--out bench/results/sync_plan_sim.txt] [--skip-calibration]

**Shapes.** Each model's HF tensors come from its released ``config.json`` (``tests/released/`` for
DeepSeek-V3, ``bench/configs/`` for the Qwen models, sources in ``bench/configs/README.md``): the
transformers model is built on the meta device (no weights allocated) and its state dict taken back
to checkpoint names (``revert_weight_conversion``: one tensor per expert), then
``reshard_layouts.layouts_from_bridge`` gives the planner's layouts from the bridge's mapping table, as
``PlannedExport`` does. DeepSeek-V3's multi-token-prediction layer stays with the trainer (the
engine serves the main model). Every element is bf16 (2 bytes): the released FP8 checkpoint's
scales are not synced.

**Plans** (``megatron_bridge.sync_plan``; its docstring defines placement, calls and extra memory):
``rank-0`` is today's broadcast transport, phase after phase (gather to trainer rank 0, pack,
broadcast to one receiver per engine, hand-off to each engine's workers); ``s2s direct`` sends every
planned slice from its owner to every replica; ``s2s relay`` sends it to replica 0, which forwards
along a chain of replicas; ``s2s engine`` is what rltrain's ``shard_to_shard`` transport runs
today with its default relay fan-out: every owner sends straight to replica 0's receiver (its
engine process, on the replica's first GPU), each receiver passes every message on to the next
replica's, and each hands its workers their regions (a receive in every worker, ``s2s relay``, is
the next step). The planner (``reshard.plan_weight_sync``) runs for every engine rank
of one replica (the replicas are identical up to GPU numbering): every number is exact for the
stated layouts, nothing is sampled or scaled.

**Time model** (``sync_plan.Bandwidths``, ``gpu_seconds``): per GPU and direction, NVLink 450 GB/s
(H100 SXM: 900 GB/s bidirectional) within a node, 50 GB/s between nodes (one 400 Gb/s NIC per GPU);
a GPU's time in a phase is its busiest link direction (the two link classes and the two directions
run at once), plus 20 µs per call it takes part in, plus every byte it packs or unpacks at 1.5 TB/s
(HBM ~3 TB/s, each copied byte read and written). A phase lasts as long as its slowest GPU; a
relay chain adds its fill ((replicas − 1) messages over one hop); phases add up. Left out:
congestion in the network fabric and NVSwitch, PCIe between NIC and GPU, NCCL's protocol overhead
and channel limits, the engine's own load into its parameters (equal in every plan), CPU-side
Python per call, and any overlap of the sync with compute.

**Lower bound** (issue #36's definition): the largest bytes any engine GPU must end up with, at
network speed (trainer and engines are on separate nodes, so the bytes cross the network); ``ratio``
= predicted / bound. It holds for plans where each engine GPU takes its bytes in over its own NIC.
**Node floor** (``sync_plan.node_floor_seconds``), a floor for any plan: an engine node's distinct
bytes (replicas sharing a node need one copy) over all its GPUs' NICs at once, the rest of each
GPU's bytes over NVLink inside the node. It is lower than the bound where replicas share a node
(Qwen2.5-7B's eight TP-1 engines on one node), equal to it within 1% elsewhere.

**Peers' published figures** (as quoted in issue #36; their layouts beyond what is named there are
not published, ours are stated in the table): DeepSeek-V3 2.4 s, PP16×EP16 → TP32×DP8 on 256+256
H100s (NeMo-RL's shard-to-shard refit, expert-TP 1, no generation PP); Qwen3-235B-A22B 11–15 s with
verl's sparse delta against 246–266 s for its full broadcast; Qwen3-30B-A3B EP8×PP2 → TP8×DP2
0.74–1.0 s.

**Calibration** (this machine, CPU, gloo): (1) gloo point-to-point bytes/s between two local
processes (64 MiB messages, one direction, best of 3 runs of 8), (2) the per-call cost (4-byte
messages, 2000 in a row), (3) memcpy bytes/s (best of 5 copies of 256 MiB), then (4) a real
planned sync: a 4-layer model (hidden 1024, vocabulary 32,000, fp32), trainer TP 4 → engine
TP 2, engine rank 0's planned slices sent by one process (holding the four trainer shards) to
another, once one message per slice (as ``PlannedExport`` sends today) and once packed into 16 MiB
messages. The same ``gpu_seconds`` model, given (1)–(3) as its link, call and copy constants,
predicts each; the table prints predicted, measured (best of 3) and their ratio. The GPU
calibration (NCCL point-to-point over NVLink and the network, CUDA IPC, HBM copies) is pending:
no GPU was lent to this task.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run_header import run_header, write_results  # noqa: E402
from megatron_bridge import sync_plan as sp  # noqa: E402
from megatron_bridge import sync_time as st  # noqa: E402
from megatron_bridge.reshard import EngineLayout, TrainerLayout  # noqa: E402

GB = 1e9


@dataclass(frozen=True)
class Case:
    name: str
    config: str
    """Path of the released config.json, relative to the repository root."""
    trainer: TrainerLayout
    trainer_dp: int
    engine: EngineLayout
    engine_pp: int
    engine_replicas: int
    peers: str

    def placement(self) -> sp.Placement:
        """The case's trainer and engine GPUs as the sync-plan model places them."""
        return sp.Placement(
            trainer=self.trainer,
            trainer_dp=self.trainer_dp,
            engine=self.engine,
            engine_pp=self.engine_pp,
            engine_replicas=self.engine_replicas,
        )


def _trainer(config: dict, **kw) -> TrainerLayout:
    experts = config.get("n_routed_experts") or config.get("num_experts") or 0
    return TrainerLayout(num_layers=config["num_hidden_layers"], num_experts=experts, **kw)


def cases() -> list[Case]:
    ds = "tests/released/deepseek-v3/config.json"
    q235 = "bench/configs/qwen3-235b-a22b/config.json"
    q30 = "bench/configs/qwen3-30b-a3b/config.json"
    q72 = "bench/configs/qwen2.5-72b-instruct/config.json"
    q7 = "bench/configs/qwen2.5-7b/config.json"
    cfg = {p: json.loads((ROOT / p).read_text()) for p in (ds, q235, q30, q72, q7)}
    # DeepSeek-V3's 61 layers over 16 stages: 3 on the first, 2 on the last, 4 on each other
    ds_stages = dict(pp=16, first_stage_layers=3, last_stage_layers=2)
    return [
        Case(
            "DeepSeek-V3 PP16xEP16 -> TP32xDP8", ds,
            _trainer(cfg[ds], tp=1, ep=16, etp=1, **ds_stages), 16,
            EngineLayout(tp=32, ep=32), 1, 8, "2.4 s (NeMo-RL)",
        ),
        Case(
            "DeepSeek-V3 PP16xEP8xETP2 -> TP16xPP2xDP8", ds,
            _trainer(cfg[ds], tp=1, ep=8, etp=2, **ds_stages), 16,
            EngineLayout(tp=16, ep=16), 2, 8, "none (NeMo-RL's refit: ETP 1, no generation PP)",
        ),
        Case(
            "Qwen3-235B-A22B TP4xPP4xEP16 -> TP16xDP4", q235,
            _trainer(cfg[q235], tp=4, pp=4, ep=16, etp=1, first_stage_layers=23, last_stage_layers=23),
            4, EngineLayout(tp=16, ep=16), 1, 4, "11-15 s sparse delta, 246-266 s broadcast (verl)",
        ),
        Case(
            "Qwen3-30B-A3B EP8xPP2 -> TP8xDP2", q30,
            _trainer(cfg[q30], tp=1, pp=2, ep=8, etp=1), 8,
            EngineLayout(tp=8), 1, 2, "0.74-1.0 s",
        ),
        Case(
            "Qwen2.5-72B TP8xPP4 -> TP8xDP4", q72,
            _trainer(cfg[q72], tp=8, pp=4), 1, EngineLayout(tp=8), 1, 4, "none quoted",
        ),
        Case(
            "Qwen2.5-7B TP2xDP4 -> TP1xDP8 (1+1 nodes)", q7,
            _trainer(cfg[q7], tp=2), 4, EngineLayout(tp=1), 1, 8, "none quoted",
        ),
    ]  # fmt: skip


def hf_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint-named HF shapes of ``config``'s model, built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    fields = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")}
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return {k: tuple(v.shape) for k, v in revert_weight_conversion(model, model.state_dict()).items()}


def layouts_of(config_path: str) -> list:
    from megatron_bridge.bridge import Bridge
    from megatron_bridge.reshard_layouts import layouts_from_bridge

    config = json.loads((ROOT / config_path).read_text())
    bridge = Bridge.from_hf_config(config).main_model()
    return layouts_from_bridge(bridge, hf_shapes(config))


def nodes(gpus: int, per_node: int = 8) -> int:
    return -(-gpus // per_node)


def describe(case: Case) -> str:
    t = case.trainer
    dp = case.trainer_dp
    gpus = t.tp * t.pp * dp
    expert = (
        f" EP{t.ep} ETP{t.etp or t.tp} EDP{t.tp * dp // (t.ep * (t.etp or t.tp))}" if t.num_experts else ""
    )
    stages = ""
    if t.first_stage_layers or t.last_stage_layers:
        stages = f" (first stage {t.first_stage_layers} layers, last {t.last_stage_layers})"
    e = case.engine
    egpus = e.tp * case.engine_pp * case.engine_replicas
    return (
        f"  trainer: TP{t.tp} PP{t.pp} DP{dp}{expert}{stages}; {gpus} GPUs on {nodes(gpus)} nodes\n"
        f"  engine:  TP{e.tp} EP{e.ep} PP{case.engine_pp} x {case.engine_replicas} replicas; "
        f"{egpus} GPUs on {nodes(egpus)} nodes after the trainer's"
    )


def simulate(case: Case, bw: st.Bandwidths) -> tuple[list[str], dict]:
    started = time.perf_counter()
    layouts = layouts_of(case.config)
    params = sum(math.prod(t.shape) for t in layouts)
    place = case.placement()
    plan = sp.replica_plan(layouts, place)
    plans = {
        "rank-0": sp.rank0(layouts, place, plan=plan),
        "s2s direct": sp.shard_to_shard(layouts, place, fanout="direct", plan=plan),
        "s2s relay": sp.shard_to_shard(layouts, place, fanout="relay", plan=plan),
        "s2s engine": sp.shard_to_engine(layouts, place, fanout="relay", plan=plan),
    }
    bound = st.lower_bound_seconds(plans["s2s relay"], bw)
    floor = st.node_floor_seconds(plans["s2s relay"], place, bw)
    lines = [
        f"{case.name}: {params / 1e9:.2f} B parameters in {len(layouts)} HF tensors "
        f"({params * 2 / GB:.1f} GB bf16); peers: {case.peers}",
        describe(case),
        f"  lower bound {bound:.3f} s (largest engine GPU: {max(plans['s2s relay'].need.values()) / GB:.2f} GB "
        f"at {bw.net / GB:.0f} GB/s); node floor {floor:.3f} s; plans built in "
        f"{time.perf_counter() - started:.1f} s",
        "  plan         predicted s  / bound | max sent net  nvl | max recv net  nvl | total net  nvl TB"
        " |    calls  max/GPU | extra GiB (GPU)",
    ]
    row = {"case": case.name, "bound": bound, "floor": floor, "peers": case.peers}
    for name, p in plans.items():
        s = st.summarize(p)
        seconds = st.predicted_seconds(p, bw)
        row[name] = seconds
        lines.append(
            f"  {name:<11} {seconds:>11.3f} {seconds / bound:>7.2f}x | "
            f"{s.max_sent['net'] / GB:>8.1f} {s.max_sent['nvlink'] / GB:>5.1f} | "
            f"{s.max_received['net'] / GB:>8.1f} {s.max_received['nvlink'] / GB:>5.1f} | "
            f"{s.total_sent['net'] / 1e12:>8.2f} {s.total_sent['nvlink'] / 1e12:>5.2f} | "
            f"{s.calls:>8} {s.max_messages:>8} | {s.max_extra / 2**30:>6.2f} ({s.max_extra_gpu})"
        )
    phases = ", ".join(f"{ph.name} {st.phase_seconds(ph, bw):.2f} s" for ph in plans["rank-0"].phases)
    lines.append(f"  rank-0 phases: {phases}")
    return lines, row


# ---- calibration on this machine -------------------------------------------------------------


def _calibration_worker(rank: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    big = torch.empty(64 << 20, dtype=torch.uint8)
    best = math.inf
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(8):
            dist.send(big, 1) if rank == 0 else dist.recv(big, 0)
        dist.barrier()
        best = min(best, time.perf_counter() - start)
    results["gloo_bytes_per_s"] = 8 * big.numel() / best
    small = torch.empty(1, dtype=torch.int32)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(2000):
        dist.send(small, 1) if rank == 0 else dist.recv(small, 0)
    dist.barrier()
    results["call_seconds"] = (time.perf_counter() - start) / 2000
    state = _sync_state(rank)
    for packed in (False, True):
        best = math.inf
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            _planned_sync(rank, packed, state)
            dist.barrier()
            best = min(best, time.perf_counter() - start)
        results["measured_packed" if packed else "measured_slices"] = best
    if rank == 1:
        queue.put(results)
    dist.destroy_process_group()


CAL_BUCKET = 16 << 20


def _calibration_case():
    from megatron_bridge.reshard_layouts import decoder_layouts

    layouts = decoder_layouts(
        num_layers=4, hidden_size=1024, num_heads=16, num_kv_heads=4, head_dim=64,
        intermediate_size=2816, vocab_size=32000, tie_word_embeddings=False,
    )  # fmt: skip
    trainer = TrainerLayout(tp=4, num_layers=4)
    place = sp.Placement(trainer=trainer, trainer_dp=1, engine=EngineLayout(tp=2), dtype_bytes=4)
    copies = sp.replica_plan(layouts, place)[(0, 0)]
    return layouts, trainer, copies


@dataclass
class _SyncState:
    """One side of the CPU planned sync, allocated and touched before it is timed (the trainer's
    shards exist, and so do the engine's parameters)."""

    pieces: list
    """Sender: each planned slice (a view of its shard). Receiver: each slice's destination."""
    sizes: list[int]
    """Elements of each slice."""
    flat: object
    """The message buffer of the packed variant."""


def _sync_state(rank: int) -> _SyncState:
    import torch

    from megatron_bridge.reshard import trainer_range

    layouts, trainer, copies = _calibration_case()
    by_name = {t.hf_name: t for t in layouts}
    sizes = [math.prod(s.stop - s.start for s in c.src) for c in copies]
    flat = torch.zeros(max(CAL_BUCKET // 4, *sizes))
    if rank == 1:
        return _SyncState([torch.zeros([s.stop - s.start for s in c.src]) for c in copies], sizes, flat)
    shards = {}
    for c in copies:
        t = by_name[c.hf_name]
        have = trainer_range(t, trainer, c.source.tp)
        shape = list(t.shape)
        if have is not None:
            shape[t.split_dim] = have[1] - have[0]
        shards.setdefault((c.hf_name, c.source.tp), torch.ones(shape))
    return _SyncState([shards[(c.hf_name, c.source.tp)][c.src] for c in copies], sizes, flat)


def _planned_sync(rank: int, packed: bool, state: _SyncState) -> None:
    """Engine rank 0's planned slices, from the process holding every trainer shard (rank 0) to the
    engine's (rank 1): one message per slice, or packed into ``CAL_BUCKET`` messages (a larger
    slice alone)."""
    import torch.distributed as dist

    if not packed:
        for piece in state.pieces:
            dist.send(piece.contiguous(), 1) if rank == 0 else dist.recv(piece, 0)
        return
    limit = CAL_BUCKET // 4
    batch: list[int] = []
    used = 0
    for i, n in enumerate(state.sizes):
        if used and used + n > limit:
            _exchange(rank, state, batch, used)
            batch, used = [], 0
        batch.append(i)
        used += n
    _exchange(rank, state, batch, used)


def _exchange(rank: int, state: _SyncState, batch: list[int], used: int) -> None:
    """One packed message: the sender copies the slices in and sends; the receiver copies them out."""
    import torch.distributed as dist

    flat = state.flat[:used]
    offset = 0
    if rank == 0:
        for i in batch:
            flat[offset : offset + state.sizes[i]].view(state.pieces[i].shape).copy_(state.pieces[i])
            offset += state.sizes[i]
        dist.send(flat, 1)
        return
    dist.recv(flat, 0)
    for i in batch:
        state.pieces[i].view(-1).copy_(flat[offset : offset + state.sizes[i]])
        offset += state.sizes[i]


def memcpy_bytes_per_s() -> float:
    import torch

    src = torch.ones(256 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return src.numel() / best


def predict_calibration(gloo: float, call: float, memcpy: float) -> dict[str, float]:
    """The time model's prediction of the two planned CPU syncs, with this machine's constants."""
    _, _, copies = _calibration_case()
    bw = st.Bandwidths(nvlink=gloo, net=gloo, memcpy=memcpy, latency=call)
    sizes = [sp.copy_bytes(c, 4) for c in copies]
    total = sum(sizes)
    # one message a slice; each slice is a whole trainer shard here (TP 4 -> 2), sent without a copy
    sender = sp.GpuTraffic(sent={"nvlink": 0, "net": total}, messages=len(copies))
    receiver = sp.GpuTraffic(received={"nvlink": 0, "net": total}, messages=len(copies))
    slices = max(st.gpu_seconds(sender, bw), st.gpu_seconds(receiver, bw))
    messages = len(sp.bucket_sizes(sizes, CAL_BUCKET))
    sender = sp.GpuTraffic(sent={"nvlink": 0, "net": total}, messages=messages, packed=total)
    receiver = sp.GpuTraffic(received={"nvlink": 0, "net": total}, messages=messages, packed=total)
    packed = max(st.gpu_seconds(sender, bw), st.gpu_seconds(receiver, bw))
    return {
        "slices": slices,
        "packed": packed,
        "bytes": total,
        "num_slices": len(copies),
        "messages": messages,
    }


def calibrate() -> list[str]:
    import socket

    import torch.multiprocessing as mp

    memcpy = memcpy_bytes_per_s()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_calibration_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    gloo, call = results["gloo_bytes_per_s"], results["call_seconds"]
    predicted = predict_calibration(gloo, call, memcpy)
    lines = [
        "Calibration on this machine (CPU, gloo over loopback, 2 processes):",
        f"  gloo point-to-point {gloo / GB:.2f} GB/s (64 MiB messages); per call {call * 1e6:.1f} us "
        f"(4-byte messages); memcpy {memcpy / GB:.2f} GB/s (256 MiB)",
        f"  planned sync: trainer TP4 -> engine TP2, engine rank 0: {predicted['bytes'] / 1e6:.1f} MB fp32 "
        f"in {predicted['num_slices']} slices",
        "  variant                       predicted s  measured s  measured/predicted",
    ]
    for key, label in (
        ("slices", "one message per slice"),
        ("packed", f"packed, {predicted['messages']} x <=16 MiB"),
    ):
        measured = results[f"measured_{key}"]
        lines.append(
            f"  {label:<29} {predicted[key]:>11.3f} {measured:>11.3f} {measured / predicted[key]:>18.2f}"
        )
    lines.append(
        "  GPU calibration (NCCL over NVLink and the network, CUDA IPC, HBM copies): pending, no GPU lent"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip-calibration", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    lines = run_header("sync_plan_sim")
    bw = st.Bandwidths()
    lines.append(
        f"Time model: NVLink {bw.nvlink / GB:.0f} GB/s, network {bw.net / GB:.0f} GB/s per GPU and direction; "
        f"{bw.latency * 1e6:.0f} us a call; packing {bw.memcpy / 1e12:.1f} TB/s; bf16; 8 GPUs a node"
    )
    rows = []
    for case in cases():
        case_lines, row = simulate(case, bw)
        rows.append(row)
        lines += ["", *case_lines]
        print("\n".join(["", *case_lines]), flush=True)
    lines += ["", "Summary (predicted s; ratio to the lower bound):"]
    lines.append(
        "  case                                          bound s  node floor s  rank-0 s (ratio)  "
        "s2s relay       s2s direct      s2s engine (runs now)  peers"
    )
    for r in rows:
        lines.append(
            f"  {r['case']:<45} {r['bound']:>7.3f} {r['floor']:>13.3f} {r['rank-0']:>8.2f} "
            f"({r['rank-0'] / r['bound']:>4.0f}x)  {r['s2s relay']:>6.3f} ({r['s2s relay'] / r['bound']:.2f}x)  "
            f"{r['s2s direct']:>6.3f} ({r['s2s direct'] / r['bound']:.2f}x)  "
            f"{r['s2s engine']:>8.3f} ({r['s2s engine'] / r['bound']:>5.1f}x)      {r['peers']}"
        )
    if not args.skip_calibration:
        lines += ["", *calibrate()]
    write_results(lines, started=started, out=args.out)


if __name__ == "__main__":
    main()
