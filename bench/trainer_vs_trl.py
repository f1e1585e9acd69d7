"""Time per PPO step: rltrain against Hugging Face TRL's PPO trainer, same model, prompts and sizes, CPU.

    pip install "trl==1.12.0"    # benchmark-only dependency; 1.12.0 is the last TRL with a PPO trainer
    python bench/trainer_vs_trl.py [--recipe R] [--steps 6] [--rounds 2] [key=value ...]

Both sides run one recipe (default ``recipes/quickstart_cpu.yaml``; also
``recipes/smollm2_135m_arith_cpu.yaml rollout.n=4`` for SmolLM2-135M), plus any overrides. The
trainers are interleaved run by run: each of ``--rounds`` rounds runs rltrain, then TRL at one
thread, then TRL at the machine's core count, so a drift in the machine's speed hits all of them.
Before each run the script waits (up to ``--settle-s``) for the 1-minute load average to fall to
the core count and records it; if it stayed above before any run, the ratios are not reported.
Each trainer's time per step is the median over every step of its runs but each run's first.

- rltrain: the recipe through ``rltrain train`` in a subprocess (see ``trainer_stage_breakdown.py``),
  ``--steps`` steps; a step's time is its ``timing_s/step``.
  Megatron actor/critic/reference, vLLM rollout, rule reward, Ray workers (Ray gives each worker
  ``OMP_NUM_THREADS=1`` for its CPU share of 0.5, so torch runs one thread per worker).
- TRL: ``trl.experimental.ppo.PPOTrainer`` in this process, ``--steps`` steps; a step's time is the
  wall time between consecutive ``on_step_end`` callbacks. It gets the
  same policy (the recipe's model: the tiny llama after its supervised warm-up, or SmolLM2; from
  ``resolve_model_dir``), a copy as reference, the same chat-templated arithmetic prompts, each
  repeated ``rollout.n`` times so that a step sees ``train_batch_size * n`` sequences, the same
  response length, temperature, mini-batches, micro-batch size, PPO epochs, clip ratio, KL
  coefficient (k1, in the reward), gamma, lambda, learning rate, stop at eos, fp32.
  Its value and reward models are ``LlamaForSequenceClassification`` (one label) built from the
  same tiny config with random weights: TRL needs both as modules; rltrain's reward is a rule
  function and its critic starts from the policy's weights. This is a timing comparison, not a
  learning comparison. TRL is timed at ``torch.set_num_threads(1)`` (as rltrain's workers) and at
  the machine's core count.

Differences that stay: TRL generates with ``transformers.generate`` (no vLLM), updates policy and
value in one backward pass, scores with a reward-model forward, and with one micro-batch per
mini-batch its gradient accumulation makes one optimizer step per PPO step where rltrain makes one
per mini-batch. Printed: every run's step times, the medians and the ratio TRL / rltrain, measured
in this run.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

RECIPE = "recipes/quickstart_cpu.yaml"


def time_rltrain(*, recipe: str, steps: int, overrides: list[str], run_root: Path) -> list[float]:
    """Every step's ``timing_s/step`` of one ``rltrain train`` run of ``recipe``."""
    from trainer_stage_breakdown import run_recipe

    from rltrain.logging import metrics as mk
    from rltrain.logging.plot import read_metrics

    _, run_dir = run_recipe(recipe=recipe, steps=steps, overrides=overrides, run_root=run_root)
    return [r[mk.TIMING_STEP] for r in read_metrics(run_dir) if mk.TIMING_STEP in r]


def step_clock():
    """A ``TrainerCallback`` whose ``seconds`` lists each PPO step's wall time (from train begin)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.last = 0.0
            self.seconds: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.seconds.append(now - self.last)
            self.last = now

    return StepClock()


def trl_sizes(config) -> dict[str, int | float]:
    """PPOConfig fields that match the rltrain recipe's sizes and coefficients."""
    n = config.rollout.n
    batch = config.data.train_batch_size * n
    mini = config.actor.ppo_mini_batch_size * n
    micro = min(config.actor.ppo_micro_batch_size_per_gpu, mini)
    return dict(
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        num_mini_batches=batch // mini,
        local_rollout_forward_batch_size=batch,
        num_ppo_epochs=config.actor.ppo_epochs,
        response_length=config.rollout.response_length,
        temperature=config.rollout.temperature,
        cliprange=config.actor.clip_ratio,
        kl_coef=config.algorithm.kl_ctrl.kl_coef,
        gamma=config.algorithm.gamma,
        lam=config.algorithm.lam,
        learning_rate=config.actor.optim.lr,
        weight_decay=config.actor.optim.weight_decay,
    )


def time_trl(*, config, model_dir: Path, steps: int, threads: int, out_dir: Path) -> list[float]:
    """Seconds of each of ``steps`` TRL PPO steps at ``threads`` torch threads."""
    import torch
    from datasets import Dataset
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from rltrain.trainer.run import build_data

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    prompts = [example.prompt_ids for example in build_data(config, tokenizer).train.dataset]
    dataset = Dataset.from_dict({"input_ids": [ids for ids in prompts for _ in range(config.rollout.n)]})
    sizes = trl_sizes(config)
    batch = sizes["per_device_train_batch_size"] * sizes["gradient_accumulation_steps"]
    if len(dataset) < batch:  # TRL's dataloader drops the ragged batch and would then loop forever
        raise ValueError(f"{len(dataset)} prompt rows for TRL, fewer than one batch of {batch}")
    args = PPOConfig(
        output_dir=str(out_dir),
        total_episodes=batch * steps,
        kl_estimator="k1",
        stop_token="eos",
        num_sample_generations=0,
        vf_coef=1.0,
        seed=config.trainer.seed,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        **sizes,
    )
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = copy.deepcopy(policy)
    head_config = AutoConfig.from_pretrained(model_dir, num_labels=1)
    torch.manual_seed(0)
    value = AutoModelForSequenceClassification.from_config(head_config, dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_config(head_config, dtype=torch.float32)
    clock = step_clock()
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        train_dataset=dataset,
        value_model=value,
        callbacks=[clock],
    )
    trainer.train()
    if len(clock.seconds) != steps:
        raise RuntimeError(f"TRL ran {len(clock.seconds)} steps, expected {steps}")
    return clock.seconds


def settled_load(*, cores: int, settle_s: float) -> float:
    """The 1-minute load average, after waiting up to ``settle_s`` for it to fall to ``cores``."""
    deadline = time.monotonic() + settle_s
    while os.getloadavg()[0] > cores and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default=RECIPE, help=f"recipe both trainers run (default {RECIPE})")
    parser.add_argument(
        "--steps", type=int, default=6, help="PPO steps per run (the first of each run is not counted)"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds of runs; each round runs every trainer once, in turn"
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=90.0,
        help="wait up to this long before a run for the load to settle",
    )
    parser.add_argument("--out", help="also write the result to this file")
    parser.add_argument("overrides", nargs="*", help="overrides of the recipe")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step of each run is warm-up)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    import trl

    from rltrain.config import load_config
    from rltrain.models.source import resolve_model_dir

    cores = os.cpu_count() or 1
    config = load_config(args.recipe, args.overrides)
    model_dir = resolve_model_dir(config.model, data=config.data)
    threads_of = {f"TRL PPO, {t} thread(s)": t for t in sorted({1, cores})}  # trainer -> TRL threads
    trainers = ["rltrain", *threads_of]
    steps: dict[str, list[float]] = {name: [] for name in trainers}
    runs: list[tuple[int, str, float, list[float]]] = []  # (round, trainer, load before, step times)
    with tempfile.TemporaryDirectory(prefix="bench_vs_trl_") as tmp:
        for round_ in range(args.rounds):
            for name in trainers:
                load = settled_load(cores=cores, settle_s=args.settle_s)
                out = Path(tmp) / f"r{round_}_{len(runs)}"
                if name == "rltrain":
                    per_step = time_rltrain(
                        recipe=args.recipe, steps=args.steps, overrides=args.overrides, run_root=out
                    )
                else:
                    per_step = time_trl(
                        config=config,
                        model_dir=model_dir,
                        steps=args.steps,
                        threads=threads_of[name],
                        out_dir=out,
                    )
                runs.append((round_, name, load, per_step))
                steps[name].extend(per_step[1:])
                print(f"round {round_ + 1}, {name}: {_fmt(per_step)} (load before {load:.1f})", flush=True)

    loads = [load for _, _, load, _ in runs]
    busy = [f"{name} in round {r + 1} ({load:.1f})" for r, name, load, _ in runs if load > cores]
    rl_median = statistics.median(steps["rltrain"])
    sizes = trl_sizes(config)
    lines = [
        f"recipe: {args.recipe} {' '.join(args.overrides)}".rstrip(),
        f"model: {model_dir}",
        f"trl {trl.__version__}; {args.rounds} round(s), each running rltrain, then TRL at each thread count, "
        f"{args.steps} steps a run; medians over every step but each run's first",
        f"sequences per step: {config.data.train_batch_size} prompts x n={config.rollout.n}; "
        f"response_length {config.rollout.response_length}; TRL PPOConfig sizes: {sizes}",
    ]
    lines += [
        f"round {r + 1}, {name} s/step: {_fmt(s)} (1-min load before: {load:.1f})"
        for r, name, load, s in runs
    ]
    lines.append(f"{'trainer':<24}{'median s/step':>14}{'steps':>7}{'TRL / rltrain':>16}")
    for name in trainers:
        median = statistics.median(steps[name])
        ratio = "" if name == "rltrain" or busy else f"{median / rl_median:.2f}x"
        lines.append(f"{name:<24}{median:>14.3f}{len(steps[name]):>7}{ratio:>16}")
    if busy:
        lines.append(
            f"no ratio reported: the load average exceeded the {cores} cores before {', '.join(busy)}"
        )
    lines.append(
        f"1-min load average before the runs: min {min(loads):.1f}, max {max(loads):.1f}; (1, 5, 15 min) "
        "at the end: " + ", ".join(f"{x:.1f}" for x in os.getloadavg())
    )
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
        print(f"written to {args.out}")
    return 0


def _fmt(seconds: list[float]) -> str:
    return "[" + ", ".join(f"{s:.2f}" for s in seconds) + "]"


if __name__ == "__main__":
    sys.exit(main())
