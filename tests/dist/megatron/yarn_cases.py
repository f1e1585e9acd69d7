"""Rank functions of the YaRN tests: Megatron built from a released config with YaRN, the checkpoint's
weights loaded through the bridge, against transformers on sequences past the YaRN pre-training
length (``original_max_position_embeddings``)."""

from __future__ import annotations

import copy
from typing import Any

import torch

SEQ = 48
"""Tokens per row: three times the tiny configs' original_max_position_embeddings (16)."""
RESPONSE = 24


def _batch(vocab_size: int) -> Any:
    """Left-padded prompts and right-padded responses, every row reaching past position 16."""
    from rltrain.algo.token_batch import TokenBatch

    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab_size, (3, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding of a prompt
    mask[2, SEQ - 5 :] = 0  # right padding of a response
    return TokenBatch(input_ids=ids * mask, attention_mask=mask, response_len=RESPONSE)


def _hf_logprobs(reference: Any, batch: Any) -> torch.Tensor:
    mask = batch.attention_mask
    with torch.no_grad():
        logits = reference(
            input_ids=batch.input_ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)
        ).logits[:, -RESPONSE - 1 : -1]
    log_p = torch.log_softmax(logits.float(), -1)
    return log_p.gather(-1, batch.input_ids[:, -RESPONSE:, None]).squeeze(-1)


def yarn_parity_case(hf_dirs: dict[str, str]) -> dict[str, float]:
    """For each checkpoint (one rank, fp32): max |Megatron − transformers| of the full logits of a
    2×SEQ probe (unpadded rows), and of the response log-probs of the trainer's packed (THD) and
    padded forwards; ``<name>_dropped``: the logits diff of a Megatron built with the YaRN block
    replaced by plain RoPE (what a builder that ignores it computes), which must be large."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_bridge.hf_io import HFCheckpointReader
    from megatron_bridge.live import bridge_for_chunks, load_hf_weights
    from megatron_bridge.verify import megatron_logits, probe_batch
    from rltrain.config.parallel import ParallelConfig
    from rltrain.megatron.micro_batches import MicroBatching
    from rltrain.megatron.parallel import ParallelContext
    from rltrain.megatron.worker import MegatronWorker

    out: dict[str, float] = {}
    for name, hf_dir in hf_dirs.items():
        config = AutoConfig.from_pretrained(hf_dir)
        reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        ids = probe_batch(config.vocab_size, seq=SEQ)
        with torch.no_grad():
            hf_logits = reference(input_ids=ids).logits.float()
        batch = _batch(config.vocab_size)
        ref_lp = _hf_logprobs(reference, batch)
        resp = batch.response_mask.bool()
        dropped = copy.deepcopy(config)
        dropped.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
        for variant, hf_config in (("", config), ("_dropped", dropped)):
            for padding in (True, False) if not variant else (True,):
                ctx = ParallelContext.initialize(ParallelConfig())
                worker = MegatronWorker(
                    hf_config,
                    ctx=ctx,
                    role="reference",
                    params_dtype=torch.float32,
                    forward_batching=MicroBatching(micro_batch_size=3, use_remove_padding=padding),
                )
                bridge = bridge_for_chunks(hf_config, worker.chunks, ctx)
                load_hf_weights(worker.chunks, ctx, bridge, HFCheckpointReader(hf_dir))
                ours = worker.compute_log_prob(batch)
                kind = "packed" if padding else "padded"
                out[f"{name}{variant}_{kind}_logprobs"] = float((ours.logprobs - ref_lp)[resp].abs().max())
                if padding:
                    logits = megatron_logits(worker.chunks, ctx, ids, vocab_size=config.vocab_size)
                    out[f"{name}{variant}_logits"] = float((logits - hf_logits).abs().max())
                ctx.destroy()
        out[f"{name}_logit_scale"] = float(hf_logits.abs().max())
    return out
