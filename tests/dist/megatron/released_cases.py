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
