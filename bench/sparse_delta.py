"""Sparse delta, measured first (issue #36 item 4): how many bf16 weights a real RL step changes, what
a lossless delta of them costs to encode and send, and whether the sync-plan time model predicts
a win over the full send at released sizes.

    flock /tmp/heavy.lock python bench/sparse_delta.py [--steps 4] [--run-dir DIR] [--set KEY=VALUE ...] \
        [--work /tmp/sparse_delta] [--out bench/results/sparse_delta_smollm2.txt]

**Updates.** ``rltrain train RECIPE`` (default ``recipes/smollm2_135m_arith_cpu.yaml``, the real
SmolLM2-135M-Instruct, fp32 on CPU) runs ``--steps`` PPO steps, saving a checkpoint every step
(``trainer.save_freq=1``, no validation). Step ``N``'s actor weights are its checkpoint exported by
``rltrain convert mcore-to-hf RUN/checkpoints/step_N/actor`` (the project's converter, without its
verification); step 0 is the HF directory the run started from (the recipe's GGUF package,
materialized by ``rltrain.models.gguf``). ``--run-dir`` reuses a run that already has the
checkpoints. The recipe's critic trains alone for ``critic.warmup_steps`` steps: the actor does not
update in those, and the script says so next to each pair.

**Changed elements** of a pair of consecutive steps: both steps' fp32 tensors cast to bf16 (round to
nearest even: what a bf16 engine receives), the elements whose 16 bits differ; ``fraction`` = changed
/ elements, over every HF tensor (SmolLM2 ties its head to the embedding: one tensor). Per-tensor
numbers are printed grouped by kind (the layer number dropped): changed fraction over the kind,
and the smallest and largest fraction of one tensor of that kind.

**Encodings** (``bench/delta_codec.py``, its docstring gives the byte counts): ``positions`` (int32
index + bf16 value, 6 bytes a changed element), ``bitmap`` (1 bit an element + 2 bytes a changed
element), ``xor_zlib`` (XOR of the bit patterns, zlib level 1). ``bytes`` is their sum over the
tensors, ``/ full`` that over the full bf16 send (2 bytes an element). ``encode s`` / ``decode s``:
the sum over tensors of one encode (from the two int16 bit tensors, already cast) and one decode
(into a new tensor), one thread; ``/ memcpy``: over one ``copy_`` of all the full bf16 bytes into
a preallocated buffer (best of 3), measured in the same run. Every decode is asserted equal, bit for
bit, to the new step's bf16 tensor.

**Prediction** (``megatron_bridge.sync_plan``'s time model and the simulator's cases and layouts,
``bench/sync_plan_sim.py``). ``sync_plan`` has no way to scale a plan's bytes by a sparsity, so
this is at the level of the simulator's lower bound: the largest engine GPU's bytes ``B`` (its
``n = B / 2`` bf16 elements) at network speed, ``full = B / net``. The delta for that GPU at the
measured fraction ``f`` (the largest over the pairs where the actor updated) in the smaller
encoding: ``min(6 f n, n / 8 + 2 f n)`` bytes over the network, plus the encoding's memory traffic
at the model's packing speed (``Bandwidths.memcpy``, 1.5 TB/s: HBM read + write), counted as the
bytes a sender touches (read the previous and the new bf16 copy, write the new one into the kept
previous copy: ``3 B``) and a receiver touches (read the delta, write the changed values: the delta
bytes twice). ``/ full`` is delta over full. ``cpu-ratio`` instead scales the encode + decode cost
by this run's measured ``(encode + decode) / memcpy`` of the better encoding (``B`` at the packing
speed times that ratio): what an encoder as slow, relative to a copy, as this script's CPU one
would cost. ``rank-0 x`` applies the wire ratio to today's rank-0 broadcast prediction (all its
phases' bytes scale; calls do not shrink, so this slightly flatters it) plus the same encoding cost.
``nvlink`` is the same delta against a full send over NVLink (450 GB/s), the colocated or same-node
case. The break-even fractions are where the delta's time equals the full send's over the network:
bytes only (``6 f = 2``; ``1/8 + 2 f = 2``), and with the packing cost above (``r = net / packing``:
``6 f + (6 + 12 f) r = 2``; ``1/8 + 2 f + (6.25 + 4 f) r = 2``). Left out: the memory for the sender's previous copy (``B`` per GPU), a delta's larger call
count, and that the trainer's fp32 master weights change more often than their bf16 casts.
"""

from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

from bench.delta_codec import ENCODERS, bf16_bits, decode  # noqa: E402
from bench.run_header import run_header, write_results  # noqa: E402

GB = 1e9
RLTRAIN = [str(Path(sys.executable).parent / "rltrain")]


def train(recipe: Path, run_root: Path, steps: int, extra: list[str]) -> Path:
    """Run the recipe for ``steps`` steps with a checkpoint every step; return the run directory."""
    overrides = [
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        f"trainer.checkpoint.max_ckpt_to_keep={steps + 1}",
        f"trainer.default_local_dir={run_root}",
        "trainer.logger=[console]",
        *extra,
    ]
    subprocess.run([*RLTRAIN, "train", str(recipe), *overrides], cwd=ROOT, check=True)
    runs = sorted(run_root.glob("*/*/config.yaml"))
    if len(runs) != 1:
        raise RuntimeError(f"{run_root}: expected one run directory, found {[str(r.parent) for r in runs]}")
    return runs[0].parent


def run_settings(run_dir: Path) -> dict:
    """The resolved config's fields this bench reports, and step 0's HF directory."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    model, actor = config["model"], config["actor"]
    if model.get("gguf_package"):
        start = Path(model["cache_dir"]).expanduser() / model["gguf_package"]
    else:
        start = Path(model["path"]).expanduser()
    if not (start / "config.json").is_file():
        raise FileNotFoundError(f"{start}: step 0's HF directory (from {run_dir / 'config.yaml'}) is missing")
    optim = actor["optim"]
    return {
        "start": start,
        "lr": optim["lr"],
        "optim": ", ".join(f"{k}={v}" for k, v in optim.items() if k != "lr"),
        "critic_warmup": config["critic"].get("warmup_steps", 0),
        "model_dtype": model.get("dtype"),
    }


def export_steps(run_dir: Path, out: Path) -> dict[int, Path]:
    """Each checkpointed step's actor as an HF directory (``rltrain convert mcore-to-hf``)."""
    dirs = {}
    for step_dir in sorted(run_dir.glob("checkpoints/step_*"), key=lambda p: int(p.name.split("_")[1])):
        step = int(step_dir.name.split("_")[1])
        dst = out / f"step_{step}"
        if not (dst / "config.json").is_file():
            cmd = [*RLTRAIN, "convert", "mcore-to-hf", str(step_dir / "actor"), str(dst), "--no-verify"]
            subprocess.run([*cmd, "--overwrite"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        dirs[step] = dst
    if not dirs:
        raise FileNotFoundError(f"{run_dir}/checkpoints: no step_N checkpoints")
    return dirs


def load_bf16_bits(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    if not tensors:
        raise FileNotFoundError(f"{hf_dir}: no safetensors")
    return {name: bf16_bits(t.float()) for name, t in sorted(tensors.items())}


def kind(name: str) -> str:
    return re.sub(r"\.\d+\.", ".N.", name)


@dataclass
class PairResult:
    """One pair of consecutive steps."""

    steps: tuple[int, int]
    numel: int = 0
    changed: int = 0
    by_kind: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    """kind -> [changed, elements, min tensor fraction, max tensor fraction]."""
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    encode_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    decode_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    memcpy_s: float = 0.0

    @property
    def fraction(self) -> float:
        return self.changed / self.numel


def measure_pair(steps: tuple[int, int], prev: dict, new: dict) -> PairResult:
    if prev.keys() != new.keys():
        raise ValueError(f"steps {steps}: tensor names differ: {sorted(prev.keys() ^ new.keys())[:10]}")
    r = PairResult(steps)
    for name in prev:
        a, b = prev[name], new[name]
        changed = int((a != b).sum())
        r.numel += a.numel()
        r.changed += changed
        k = r.by_kind.setdefault(kind(name), [0, 0, 1.0, 0.0])
        k[0] += changed
        k[1] += a.numel()
        k[2] = min(k[2], changed / a.numel())
        k[3] = max(k[3], changed / a.numel())
        for encoding, encode in ENCODERS.items():
            start = time.perf_counter()
            delta = encode(a, b)
            middle = time.perf_counter()
            out = decode(a, delta)
            r.decode_s[encoding] += time.perf_counter() - middle
            r.encode_s[encoding] += middle - start
            r.bytes[encoding] += delta.num_bytes
            assert torch.equal(out, b), f"steps {steps}: {encoding} decode of {name} is not bit-exact"
    flat = torch.cat([prev[n] for n in prev])
    dst = torch.empty_like(flat)
    dst.copy_(flat)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(flat)
        best = min(best, time.perf_counter() - start)
    r.memcpy_s = best
    return r


def measurement_lines(pairs: list[PairResult], critic_warmup: int) -> list[str]:
    lines = [
        "Changed bf16 elements per step (both steps cast to bf16):",
        "  steps   elements    changed   fraction  note",
    ]
    for r in pairs:
        note = "critic warm-up: the actor did not update" if r.steps[1] <= critic_warmup else ""
        lines.append(
            f"  {r.steps[0]}->{r.steps[1]}  {r.numel:>10,} {r.changed:>10,} {r.fraction:>10.4%}  {note}"
        )
    for r in pairs:
        if r.changed == 0:
            continue
        lines += [
            "",
            f"Per kind of tensor, steps {r.steps[0]}->{r.steps[1]} (fraction; min and max of one tensor):",
        ]
        for name, (changed, numel, low, high) in sorted(r.by_kind.items()):
            lines.append(f"  {name:<48} {numel:>11,.0f} {changed / numel:>9.4%} {low:>9.4%} {high:>9.4%}")
    lines += [
        "",
        "Encodings (sums over tensors; one thread; memcpy: one copy of the full bf16 bytes, best of 3):",
        "  steps  encoding    MB     / full  encode s  decode s  (enc+dec) / memcpy",
    ]
    for r in pairs:
        full = 2 * r.numel
        lines.append(
            f"  {r.steps[0]}->{r.steps[1]}  full     {full / 1e6:>8.2f}  1.000    memcpy {r.memcpy_s:.4f} s"
        )
        for e in ENCODERS:
            total = r.encode_s[e] + r.decode_s[e]
            lines.append(
                f"         {e:<9} {r.bytes[e] / 1e6:>8.2f} {r.bytes[e] / full:>6.3f} {r.encode_s[e]:>9.3f} "
                f"{r.decode_s[e]:>9.3f} {total / r.memcpy_s:>10.1f}x"
            )
    return lines


def delta_bytes(fraction: float, numel: int) -> tuple[str, float]:
    """The smaller of the fixed-size encodings for ``numel`` elements at ``fraction`` changed."""
    positions = 6 * fraction * numel
    bitmap = numel / 8 + 2 * fraction * numel
    return ("positions", positions) if positions <= bitmap else ("bitmap", bitmap)


def prediction_lines(fraction: float, cpu_ratio: float) -> list[str]:
    sys.path.insert(0, str(ROOT / "bench"))
    import sync_plan_sim as sim

    from megatron_bridge import sync_plan as sp
    from megatron_bridge import sync_time as st

    bw = st.Bandwidths()
    r = bw.net / bw.memcpy  # the packing cost of a byte, in network-byte times
    lines = [
        f"Prediction at f = {fraction:.4%} changed (sync_plan time model: net {bw.net / GB:.0f} GB/s, "
        f"NVLink {bw.nvlink / GB:.0f} GB/s, packing {bw.memcpy / 1e12:.1f} TB/s); the largest engine GPU's bytes B:",
        f"  break-even fractions, bytes only: positions {1 / 3:.1%}, bitmap {15 / 16:.1%}; with the packing "
        f"cost, over the network: positions {(2 - 6 * r) / (6 + 12 * r):.1%}, bitmap "
        f"{(2 - 1 / 8 - 6.25 * r) / (2 + 4 * r):.1%}",
        "  case                                        B GB   full s  s2s relay s  rank-0 s | enc  wire GB  "
        "delta s  / full  cpu-ratio s | rank-0 x s | nvlink full s delta s",
    ]
    for case in sim.cases():
        layouts = sim.layouts_of(case.config)
        place = case.placement()
        plan = sp.replica_plan(layouts, place)
        relay = sp.shard_to_shard(layouts, place, fanout="relay", plan=plan)
        rank0 = st.predicted_seconds(sp.rank0(layouts, place, plan=plan), bw)
        need = max(relay.need.values())
        full = need / bw.net
        encoding, wire = delta_bytes(fraction, need // 2)
        pack = (3 * need + 2 * wire) / bw.memcpy
        delta = wire / bw.net + pack
        cpu = wire / bw.net + cpu_ratio * need / bw.memcpy
        rank0_delta = rank0 * wire / need + pack
        nvl_full = need / bw.nvlink
        nvl_delta = wire / bw.nvlink + pack
        lines.append(
            f"  {case.name:<42} {need / GB:>6.2f} {full:>7.3f} {st.predicted_seconds(relay, bw):>11.3f} "
            f"{rank0:>9.2f} | {encoding[:3]} {wire / GB:>7.3f} {delta:>8.4f} {delta / full:>6.3f} "
            f"{cpu:>12.3f} | {rank0_delta:>10.3f} | {nvl_full:>13.4f} {nvl_delta:>7.4f}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes/smollm2_135m_arith_cpu.yaml")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--run-dir", type=Path, default=None, help="a run with step_N checkpoints to reuse")
    parser.add_argument("--set", nargs="*", default=[], help="more overrides, e.g. actor.optim.lr=1e-5")
    parser.add_argument("--work", type=Path, default=Path("/tmp/sparse_delta"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    lines = run_header("sparse_delta")
    run_dir = args.run_dir or train(args.recipe, args.work / "runs", args.steps, args.set)
    settings = run_settings(run_dir)
    lines.append(
        f"run {run_dir} ({args.recipe.name}): actor lr {settings['lr']}, {settings['optim']}; "
        f"model dtype {settings['model_dtype']}; critic warm-up {settings['critic_warmup']} step(s)"
    )
    dirs = {0: settings["start"], **export_steps(run_dir, args.work / "hf")}
    steps = sorted(dirs)
    weights = {s: load_bf16_bits(dirs[s]) for s in steps}
    pairs = [measure_pair((a, b), weights[a], weights[b]) for a, b in itertools.pairwise(steps)]
    lines += ["", *measurement_lines(pairs, settings["critic_warmup"])]
    print("\n".join(lines), flush=True)
    updated = [r for r in pairs if r.changed]
    if updated:
        fraction = max(r.fraction for r in updated)
        worst = max(updated, key=lambda r: r.fraction)
        best = min(ENCODERS, key=lambda e: worst.bytes[e] if e != "xor_zlib" else float("inf"))
        ratio = (worst.encode_s[best] + worst.decode_s[best]) / worst.memcpy_s
        lines += ["", *prediction_lines(fraction, ratio)]
    write_results(lines, started=started, out=args.out)


if __name__ == "__main__":
    main()
