"""In-place weight loads into the shared engine: readback against the checkpoint, perturb/restore,
bucketed vs single-shot loads, checksum verification, the direct load against vLLM's own reload
(also with tied embeddings, on a second engine)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_bridge.vllm_names import grouped_order
from rltrain.rollout.types import SamplingConfig
from rltrain.weight_sync import checksum
from rltrain.weight_sync.broadcast import load_buckets
from rltrain.weight_sync.buckets import BufferPool, iter_buckets, pack_bucket

pytestmark = pytest.mark.e2e

PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 3, 150], [11, 12, 13]]
GREEDY = SamplingConfig(temperature=0.0, response_length=10)


def perturbed(weights: dict[str, torch.Tensor], scale: float = 0.05) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return {n: t + scale * torch.randn(t.shape, generator=gen) for n, t in weights.items()}


def greedy(engine):
    out = engine.generate(PROMPTS, GREEDY)
    return out.response_ids, out.response_logprobs


def test_readback_equals_checkpoint_bit_for_bit(engine, tiny_llama_weights):
    # the CPU build keeps linear weights only inside prepacked kernels; readback goes through them
    back = engine.hf_weights()
    assert set(back) == set(tiny_llama_weights)
    for name, tensor in tiny_llama_weights.items():
        assert torch.equal(back[name], tensor), name
    assert engine.weights_digests() == checksum.digests(tiny_llama_weights.items())


def test_perturb_changes_greedy_and_restore_is_bit_identical(restore_weights, tiny_llama_weights):
    engine = restore_weights
    before_ids, before_lps = greedy(engine)
    new = perturbed(tiny_llama_weights)
    stats = engine.load_weights(grouped_order(new.items()))
    assert stats.num_tensors == len(new)
    assert stats.num_bytes == sum(t.numel() * 4 for t in new.values())
    ids, _ = greedy(engine)
    assert ids != before_ids
    problems = checksum.compare_digests(
        checksum.digests(tiny_llama_weights.items()), engine.weights_digests()
    )
    assert len(problems) == len(tiny_llama_weights)  # every tensor was perturbed
    assert checksum.compare_digests(checksum.digests(new.items()), engine.weights_digests()) == []

    engine.load_weights(grouped_order(tiny_llama_weights.items()))
    ids, lps = greedy(engine)
    assert ids == before_ids and lps == before_lps  # bit-identical floats


def test_many_small_bucketed_loads_equal_one_load(restore_weights, tiny_llama_weights):
    engine = restore_weights
    new = perturbed(tiny_llama_weights, scale=0.03)
    engine.load_weights(grouped_order(new.items()))
    ref_ids, ref_lps = greedy(engine)
    ref_back = engine.hf_weights()

    engine.load_weights(grouped_order(tiny_llama_weights.items()))
    buckets = list(
        iter_buckets(grouped_order(new.items()), 64 << 10)
    )  # 64 KiB: one or two fused modules each
    assert len(buckets) >= 8
    pool = BufferPool()  # one flat buffer, rewritten for every bucket as the broadcast receiver does
    stats = load_buckets(engine, (pack_bucket(b, pool=pool) for b in buckets), bucket_bytes=64 << 10)
    assert stats.num_buckets == len(buckets) and stats.num_tensors == len(new) and stats.path == "direct"
    ids, lps = greedy(engine)
    assert ids == ref_ids and lps == ref_lps
    back = engine.hf_weights()
    assert all(torch.equal(back[n], ref_back[n]) for n in ref_back)


def test_partial_fused_module_load_raises_naming_the_module(restore_weights, tiny_llama_weights):
    name = "model.layers.1.self_attn.q_proj.weight"
    with pytest.raises(
        ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj.*missing \['k_proj', 'v_proj'\]"
    ):
        restore_weights.load_weights([(name, tiny_llama_weights[name])])


def load_both_ways(engine, monkeypatch, original, new) -> dict:
    """``{path: (greedy ids, greedy logprobs, readback)}`` after loading ``original`` then ``new`` through
    vLLM's ``reload_weights`` and through the direct load."""
    results = {}
    for path in ("reload", "direct"):
        options = dataclasses.replace(engine.core.options, weight_load=path)
        monkeypatch.setattr(engine.core, "settings", dataclasses.replace(engine.settings, options=options))
        engine.load_weights(grouped_order(original.items()))
        stats = engine.load_weights(grouped_order(new.items()))
        assert stats.path == path and stats.num_tensors == len(new)
        results[path] = (*greedy(engine), engine.hf_weights())
        assert checksum.compare_digests(checksum.digests(new.items()), engine.weights_digests()) == []
    return results


@pytest.mark.parametrize("routing", [True, False], ids=["routed", "through_load_weights"])
def test_direct_load_equals_vllm_reload_bit_for_bit(
    restore_weights, tiny_llama_weights, monkeypatch, routing
):
    """Both ways the direct load places tensors: routed to each parameter's loader (llama's), and
    through the model's own ``load_weights`` (every model outside ``_ROUTED_MODELS``)."""
    monkeypatch.setattr(restore_weights.weights.direct_loader(), "routing", routing)
    new = perturbed(tiny_llama_weights, scale=0.04)
    results = load_both_ways(restore_weights, monkeypatch, tiny_llama_weights, new)
    ids, lps, back = results["direct"]
    ref_ids, ref_lps, ref_back = results["reload"]
    assert ids == ref_ids and lps == ref_lps  # the same kernels, rebuilt from the same bits
    for name, tensor in new.items():
        assert torch.equal(back[name], tensor) and torch.equal(ref_back[name], tensor), name


def test_direct_load_takes_any_order_and_refuses_a_module_loaded_twice(restore_weights, tiny_llama_weights):
    engine = restore_weights
    new = perturbed(tiny_llama_weights, scale=0.02)
    stats = engine.load_weights(reversed(list(new.items())))  # fused members far apart
    assert stats.path == "direct"
    back = engine.hf_weights()
    assert all(torch.equal(back[n], t) for n, t in new.items())
    names = [f"model.layers.0.self_attn.{m}_proj.weight" for m in "qkv"] + ["model.norm.weight"]
    stream = [(n, tiny_llama_weights[n]) for n in [*names, names[0]]]
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.qkv_proj' loaded twice"):
        engine.load_weights(stream)


@pytest.fixture(scope="module")
def tied_engine(tmp_path_factory):
    """A second engine: the tiny llama with tied embeddings (the head keeps its own packed copy)."""
    from safetensors.torch import load_file

    from rltrain.models.tiny import save_tiny_model
    from rltrain.rollout.protocol import EngineSettings
    from rltrain.rollout.vllm.engine import VllmEngine
    from rltrain.rollout.vllm.options import VllmOptions

    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny_tied"), "llama", tie_word_embeddings=True)
    eng = VllmEngine(
        str(model_dir),
        settings=EngineSettings(
            max_model_len=256, max_num_seqs=16, options=VllmOptions(kv_cache_space_gb=0.1)
        ),
    )
    yield eng, load_file(str(model_dir / "model.safetensors"))
    eng.shutdown()


def test_tied_head_follows_the_embedding_on_both_load_paths(tied_engine, monkeypatch):
    engine, original = tied_engine
    assert "lm_head.weight" not in original
    new = perturbed(original, scale=0.04)
    results = load_both_ways(engine, monkeypatch, original, new)
    for path, (_, _, back) in results.items():
        # read through the head's own kernel: before the fix, reload left it at the old embedding
        assert torch.equal(back["lm_head.weight"], new["model.embed_tokens.weight"]), path
    assert results["direct"][:2] == results["reload"][:2]
    engine.load_weights(grouped_order(original.items()))


def test_direct_load_packs_from_sent_tensors_without_keeping_them(restore_weights, tiny_llama_weights):
    """o_proj and down_proj (one tensor, TP=1, model-format shape) are packed straight from the sent
    tensors: the kernels must keep their own copies, so changing the sent tensors afterwards changes
    nothing; a tensor vLLM's loader must place itself (a rotary buffer name) still goes through it."""
    engine = restore_weights
    new = perturbed(tiny_llama_weights, scale=0.03)
    engine.load_weights(grouped_order(new.items()))
    ref_ids, ref_lps = greedy(engine)
    loader = engine.weights.direct_loader()
    layers = sum(name.endswith("o_proj.weight") for name in new)
    assert layers > 0 and loader.zero_copy_modules == 2 * layers  # o_proj and down_proj of every layer

    sent = {n: t.clone() for n, t in new.items()}
    inv_freq = ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4))  # vLLM's loader skips it
    engine.load_weights([*grouped_order(sent.items()), inv_freq])
    assert loader.zero_copy_modules == 2 * layers
    for tensor in sent.values():
        tensor.fill_(7.0)  # the trainer moves on: the engine must not see it
    ids, lps = greedy(engine)
    assert ids == ref_ids and lps == ref_lps
    back = engine.hf_weights()
    assert all(torch.equal(back[n], t) for n, t in new.items())
