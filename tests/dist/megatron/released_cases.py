"""Rank functions of the released-config tests (``tests/released``): each returns numbers to assert."""

from __future__ import annotations

import torch
from megatron_fixtures import SEED, ensure_process_group, hf_reference_logprobs, make_batch

from rltrain.config.parallel import ParallelConfig
from rltrain.megatron.parallel import ParallelContext
from rltrain.megatron.worker import MegatronWorker

CASES = ("glm-4.5-air", "kimi-k2-instruct")


def released_parity_case(
    tmp: str, names: tuple[str, ...] = CASES, seq: int = 16, response_len: int = 8
) -> dict[str, float]:
    """The actor's packed log-probs and entropies (``compute_log_prob``: THD rows, Megatron's RoPE
    through ``packed_rope``) against transformers' on the same weights, for each released config:
    the tiny model with larger random weights (a peaked distribution; random expert biases that
    decide the routing), saved, read into Megatron by the bridge. ``seq`` / ``response_len``: the
    batch's row and response lengths (``make_batch``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_bridge.hf_config import load_hf_config
    from megatron_bridge.hf_io import HFCheckpointReader
    from megatron_bridge.live import bridge_for_chunks, load_hf_weights
    from rltrain.models.tiny import add_mtp_layers, save_pretrained_with_tokenizer
    from tests.released import save_released_model

    ensure_process_group()
    out = {}
    for name in names:
        src = save_released_model(f"{tmp}/{name}/tiny", name, seed=2)
        hf = load_hf_config(src)  # Kimi-K2's kimi_k2 reads as DeepseekV3Config
        reference = AutoModelForCausalLM.from_pretrained(src, config=hf, dtype=torch.float32).eval()
        torch.manual_seed(0)
        for param in reference.parameters():
            if param.dim() > 1:
                param.data.normal_(0, 0.15)
            else:
                param.data.uniform_(0.5, 1.5)
        for param_name, param in reference.named_parameters():
            if hf.model_type == "gpt_oss" and param_name.endswith("mlp.experts.gate_up_proj"):
                # GPT-OSS: gate/up values past its swiglu_limit 7, where the GLU clamps them (at
                # std 0.3, 0.2-1% of them on this batch; at 0.15 none)
                param.data.normal_(0, 0.3)
        for buffer_name, buffer in reference.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.data.normal_(0, 0.5)
        weights = save_pretrained_with_tokenizer(
            reference, AutoTokenizer.from_pretrained(src), f"{tmp}/{name}/w"
        )
        add_mtp_layers(weights)  # GLM-4.5-Air's MTP layer, as released (transformers writes none)
        ctx = ParallelContext.initialize(ParallelConfig(), seed=SEED)
        worker = MegatronWorker(hf, ctx=ctx, role="reference")
        bridge = bridge_for_chunks(hf, worker.chunks, ctx)
        load_hf_weights(worker.chunks, ctx, bridge, HFCheckpointReader(weights))
        batch = make_batch(seq=seq, response_len=response_len, seed=5)
        ours = worker.compute_log_prob(batch)
        ctx.destroy()
        ref_lp, ref_ent, resp = hf_reference_logprobs(reference, batch)
        out[f"{name}_logprobs"] = float((ours.logprobs - ref_lp)[resp].abs().max())
        out[f"{name}_entropy"] = float((ours.entropy - ref_ent)[resp].abs().max())
        out[f"{name}_scale"] = float(ref_lp[resp].abs().max())
    return out


def gpt_oss_case(tmp: str) -> dict[str, float]:
    """GPT-OSS-20B's shrunk config: ``released_parity_case`` (rows of 48 tokens), then the actor's
    gradients of the response log-probs' sum (one ``update``, clipping off) against transformers' on
    the same weights, for the sinks, the router bias and the experts' gate/up and output biases of
    every layer: the largest difference relative to the largest reference gradient of each kind.
    The load-balancing loss is off (``router_aux_loss_coef`` 0): transformers adds none without
    ``output_router_logits``."""
    from transformers import AutoModelForCausalLM

    from megatron_bridge.hf_config import load_hf_config
    from megatron_bridge.hf_io import HFCheckpointReader
    from megatron_bridge.live import bridge_for_chunks, load_hf_weights
    from megatron_bridge.models.gpt_oss import InterleavedGatedMLP
    from rltrain.config.optim import OptimConfig
    from tests.released import save_released_model

    out = released_parity_case(tmp, ("gpt-oss-20b",), 48, 16)
    src = save_released_model(
        f"{tmp}/grad", "gpt-oss-20b", seed=3, initializer_range=0.1, router_aux_loss_coef=0.0
    )
    hf = load_hf_config(src)
    reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    torch.manual_seed(1)
    for name, param in reference.named_parameters():
        if name.endswith(("bias", "sinks")):  # transformers starts the expert biases at zero
            param.data.normal_(0, 0.5)
    reference.save_pretrained(f"{tmp}/grad_w")
    ctx = ParallelContext.initialize(ParallelConfig(), seed=SEED)
    actor = MegatronWorker(
        hf, ctx=ctx, role="actor", optim=OptimConfig(lr=1e-9, clip_grad=0.0), params_dtype=torch.float32
    )
    load_hf_weights(
        actor.chunks, ctx, bridge_for_chunks(hf, actor.chunks, ctx), HFCheckpointReader(f"{tmp}/grad_w")
    )
    batch = make_batch(seq=32, response_len=12, seed=5)
    tokens = float(batch.response_mask.sum())

    def loss_fn(output, mb):
        loss = -(output.logprobs * mb.response_mask.float()).sum() / tokens
        return loss, {"loss": loss.detach()}

    actor.update(batch, loss_fn)
    mask = batch.attention_mask
    logits = reference(
        input_ids=batch.input_ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)
    ).logits[:, -batch.response_len - 1 : -1]
    log_p = torch.log_softmax(logits.float(), -1)
    ref_lp = log_p.gather(-1, batch.input_ids[:, -batch.response_len :, None]).squeeze(-1)
    (-(ref_lp * batch.response_mask.float()).sum() / tokens).backward()
    params = {name.split("decoder.", 1)[-1]: p for name, p in actor.chunks[0].named_parameters()}
    pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    fc1 = InterleavedGatedMLP("fc1", "gate_up_proj_bias")
    for i, layer in enumerate(reference.model.layers):
        experts = layer.mlp.experts
        pairs.setdefault("sinks", []).append(
            (params[f"layers.{i}.self_attention.core_attention.softmax_offset"], layer.self_attn.sinks.grad)
        )
        pairs.setdefault("router_bias", []).append(
            (params[f"layers.{i}.mlp.router.bias"], layer.mlp.router.bias.grad)
        )
        for e in range(experts.num_experts):
            local = f"layers.{i}.mlp.experts.local_experts.{e}"
            pairs.setdefault("down_bias", []).append(
                (params[f"{local}.linear_fc2.bias"], experts.down_proj_bias.grad[e])
            )
            gate_up = fc1.to_megatron([experts.gate_up_proj_bias.grad[e]], None)[0]
            pairs.setdefault("gate_up_bias", []).append((params[f"{local}.linear_fc1.bias"], gate_up))
    for kind, items in pairs.items():
        diff = max(float((p.main_grad - ref).abs().max()) for p, ref in items)
        scale = max(float(ref.abs().max()) for _, ref in items)
        out[f"grad_{kind}"], out[f"grad_{kind}_scale"] = diff / scale, scale
    ctx.destroy()
    return out
