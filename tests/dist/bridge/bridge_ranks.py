"""Rank functions for the bridge tests (importable by name in spawned ranks)."""

from __future__ import annotations


def save_the_trainer_way(hf_dir: str, root: str) -> None:
    """The reference checkpoint: a real model, HF weights copied in, ``save_checkpoint`` (one rank)."""
    from transformers import AutoConfig

    from megatron_bridge.hf_io import HFCheckpointReader
    from megatron_bridge.live import bridge_for_chunks, load_hf_weights
    from rltrain.config.parallel import ParallelConfig
    from rltrain.convert.model import build_padded_model
    from rltrain.megatron.checkpoint import save_checkpoint
    from rltrain.megatron.parallel import ParallelContext

    config = AutoConfig.from_pretrained(hf_dir)
    ctx = ParallelContext.initialize(ParallelConfig())
    chunks = build_padded_model(config, ctx)
    load_hf_weights(chunks, ctx, bridge_for_chunks(config, chunks, ctx), HFCheckpointReader(hf_dir))
    save_checkpoint(root, step=0, ctx=ctx, chunks=chunks)
    ctx.destroy()


def entry_with_gate_and_up_swapped(*args: object) -> None:
    """``rltrain.convert.launch._entry`` on a rank whose Llama table maps ``gate_proj`` and ``up_proj``
    to each other's half of ``linear_fc1``: a mapping bug the round trip cannot see (it swaps both ways)."""
    import dataclasses

    from megatron_bridge import registry
    from megatron_bridge.mappings import GatedMLP
    from rltrain.convert import launch

    family = registry.get_family("llama")
    rows = tuple(
        dataclasses.replace(row, hf=row.up, up=row.hf) if isinstance(row, GatedMLP) else row
        for row in family.mappings
    )
    registry._FAMILIES["llama"] = dataclasses.replace(family, mappings=rows)
    launch._entry(*args)


def rope_probe_checks(
    hf_dirs: list[str], token_counts: list[int]
) -> dict[tuple[str, str, int], tuple[float, float]]:
    """Megatron built from each checkpoint's config as saved, with its RoPE scaling dropped and with
    its rope_theta halved (what a builder that mishandles RoPE would build), weights loaded from the
    checkpoint, against transformers on probes of ``token_counts`` tokens: ``(dtype, variant, tokens)
    -> (max abs diff, tolerance)`` of ``compare_logits`` (one rank)."""
    import copy

    from transformers import AutoConfig

    from megatron_bridge.hf_io import HFCheckpointReader
    from megatron_bridge.live import bridge_for_chunks, load_hf_weights
    from megatron_bridge.verify import compare_logits, megatron_logits, probe_batch
    from rltrain.config.parallel import ParallelConfig
    from rltrain.convert.model import build_padded_model
    from rltrain.megatron.parallel import ParallelContext

    ctx = ParallelContext.initialize(ParallelConfig())
    results = {}
    for hf_dir in hf_dirs:
        config = AutoConfig.from_pretrained(hf_dir)
        rope = dict(config.rope_parameters)
        variants = {
            "as saved": config,
            "scaling dropped": copy.deepcopy(config),
            "theta halved": copy.deepcopy(config),
        }
        variants["scaling dropped"].rope_parameters = {
            "rope_type": "default",
            "rope_theta": rope["rope_theta"],
        }
        variants["theta halved"].rope_parameters = {**rope, "rope_theta": rope["rope_theta"] / 2}
        for name, variant in variants.items():
            chunks = build_padded_model(variant, ctx, dtype=config.dtype)
            load_hf_weights(chunks, ctx, bridge_for_chunks(variant, chunks, ctx), HFCheckpointReader(hf_dir))
            for tokens in token_counts:
                ids = probe_batch(config.vocab_size, seq=tokens, max_positions=config.max_position_embeddings)
                ours = megatron_logits(chunks, ctx, ids, vocab_size=config.vocab_size)
                check = compare_logits(ours, hf_dir, ids, dtype=config.dtype, atol=1e-4)
                results[(str(config.dtype), name, tokens)] = (check.max_abs_diff, check.tolerance)
    ctx.destroy()
    return results


def _entry_with_yarn_mutated(args: tuple, mutate: object) -> None:
    """``launch._entry`` on a rank whose conversion reads the checkpoint's config with its YaRN block
    changed by ``mutate`` (rope_parameters → rope_parameters): the Megatron model is built, and the
    converted checkpoint's config written, from the mutated config; the weights are untouched."""
    from rltrain.convert import launch, ranks

    read = ranks.load_hf_config

    def mutated(path: object, *rest: object, **kwargs: object) -> object:
        config = read(path, *rest, **kwargs)
        config.rope_parameters = mutate(dict(config.rope_parameters))
        return config

    ranks.load_hf_config = mutated
    launch._entry(*args)


def entry_with_yarn_dropped(*args: object) -> None:
    """The YaRN block lost: plain RoPE of the same theta."""
    _entry_with_yarn_mutated(args, lambda rope: {"rope_type": "default", "rope_theta": rope["rope_theta"]})


def entry_with_yarn_factor_halved(*args: object) -> None:
    """The YaRN block changed: ``factor`` halved (other interpolated frequencies and cos/sin factor)."""
    _entry_with_yarn_mutated(args, lambda rope: {**rope, "factor": rope["factor"] / 2})


def entry_with_yarn_mscale_all_dim_dropped(*args: object) -> None:
    """The YaRN block changed: ``mscale_all_dim`` dropped (MLA's softmax scale and cos/sin factor)."""
    _entry_with_yarn_mutated(args, lambda rope: {k: v for k, v in rope.items() if k != "mscale_all_dim"})


def entry_with_mtp_norms_swapped(*args: object) -> None:
    """``launch._entry`` on a rank whose DeepSeek-V3 table maps the MTP layer's ``enorm`` and ``hnorm``
    to each other: a bug the round trip cannot see (it swaps both ways) and transformers' main
    forward never reads."""
    import dataclasses

    from megatron_bridge import registry
    from rltrain.convert import launch

    swap = {"model.layers.*.enorm.weight": "model.layers.*.hnorm.weight"}
    swap |= {v: k for k, v in swap.items()}
    family = registry.get_family("deepseek_v3")
    rows = tuple(
        dataclasses.replace(row, hf=swap[row.hf])
        if row.megatron.startswith("mtp.") and getattr(row, "hf", None) in swap
        else row
        for row in family.mappings
    )
    registry._FAMILIES["deepseek_v3"] = dataclasses.replace(family, mappings=rows)
    launch._entry(*args)


def entry_with_mtp_experts_swapped(*args: object) -> None:
    """``launch._entry`` on a rank whose DeepSeek-V3 table maps the MTP layer's experts 0 and 1 to each
    other (both ways, so the round trip undoes it)."""
    import dataclasses

    from megatron_bridge import registry
    from megatron_bridge.mappings import PerExpert
    from rltrain.convert import launch

    class Swapped(PerExpert):
        def hf_names(self, values: tuple[int, ...]) -> list[str]:
            layer, expert = values
            return self.inner.hf_names((layer, {0: 1, 1: 0}.get(expert, expert)))

    family = registry.get_family("deepseek_v3")
    rows = tuple(
        Swapped(row.inner) if isinstance(row, PerExpert) and row.megatron.startswith("mtp.") else row
        for row in family.mappings
    )
    registry._FAMILIES["deepseek_v3"] = dataclasses.replace(family, mappings=rows)
    launch._entry(*args)


def entry_dropping_mtp_on_export(*args: object) -> None:
    """``launch._entry`` on a rank whose HF writer leaves out the MTP layer's tensors (layer 4 of the
    tiny model): what a converter that does not know MTP layers writes."""
    from megatron_bridge import convert
    from rltrain.convert import launch, ranks

    def write_without_mtp(view, out, *, aux_from, progress):
        class Without:
            def names(self):
                return [n for n in view.names() if not n.startswith("model.layers.4.")]

            def info(self, name):
                return view.info(name)

            def get(self, name):
                return view.get(name)

        convert.write_hf(Without(), out, aux_from=aux_from, progress=progress)

    ranks.write_hf = write_without_mtp
    launch._entry(*args)


def released_bf16_conversions(root: str, names: tuple[str, ...]) -> dict[str, dict]:
    """One rank: each released config's tiny model in bf16 as transformers saves one (loaded with
    ``dtype=bfloat16``: the tensors it keeps in fp32, DeepSeek-V3's and GLM-4.5's
    ``e_score_correction_bias``, stay fp32 in the file), with random expert biases and its declared MTP
    layers, converted hf-to-mcore with the default verification (``rank_main``, as a conversion rank
    runs it); the reports, and each checkpoint's tensor count and dtypes."""
    import json
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_bridge.hf_config import load_hf_config
    from rltrain.convert.ranks import rank_main
    from rltrain.models.tiny import add_mtp_layers, randomize_expert_bias, save_pretrained_with_tokenizer
    from tests.released import save_released_model

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    out = {}
    for name in names:
        fp32 = save_released_model(Path(root, name, "fp32"), name, seed=2)
        model_type = json.loads((fp32 / "config.json").read_text())["model_type"]
        model = AutoModelForCausalLM.from_pretrained(fp32, config=load_hf_config(fp32), dtype=torch.bfloat16)
        src = save_pretrained_with_tokenizer(
            model, AutoTokenizer.from_pretrained(fp32), Path(root, name, "bf16")
        )
        config = json.loads((src / "config.json").read_text())
        config["model_type"] = model_type  # Kimi-K2's kimi_k2 is built by DeepseekV3Config
        (src / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        randomize_expert_bias(src)
        add_mtp_layers(src)
        with safe_open(src / "model.safetensors", "pt") as f:
            dtypes = {key: str(f.get_slice(key).get_dtype()) for key in f.keys()}  # noqa: SIM118 - a safe_open handle has no __iter__
        dst = Path(root, name, "mcore")
        dst.mkdir()
        report = rank_main("hf-to-mcore", str(src), str(dst), str(src), 1, 1, 1, True, 1e-4)
        out[name] = dict(report=report, src=str(src), dtypes=dtypes)
    return out


def gpt_oss_mutation_checks(hf_dir: str) -> dict[str, tuple[float, float]]:
    """The conversion's default verification (Megatron's fp32 logits vs transformers' on the probe,
    ``compare_logits`` at atol 1e-4) of a GPT-OSS checkpoint read by its table as it is and by three
    wrong tables whose round trip is still bit-exact: gate and up taken from each other's interleaved
    columns (weight and bias), the experts' ``down_proj`` read without its transpose (same shape when
    ffn = hidden), and the sinks loaded but dropped from the softmax (an attention that ignores them).
    ``variant -> (max abs diff, tolerance)`` (one rank)."""
    import dataclasses

    import torch
    from transformers import AutoConfig

    from megatron_bridge import registry
    from megatron_bridge.hf_io import HFCheckpointReader
    from megatron_bridge.live import bridge_for_chunks, load_hf_weights
    from megatron_bridge.mappings import GroupedExperts, RowParallel
    from megatron_bridge.models.gpt_oss import InterleavedGatedMLP, TransposedRowParallel
    from megatron_bridge.verify import compare_logits, megatron_logits, probe_batch, probe_tokens
    from rltrain.config.parallel import ParallelConfig
    from rltrain.convert.model import build_padded_model
    from rltrain.megatron.parallel import ParallelContext

    class GateUpSwapped(InterleavedGatedMLP):
        def to_megatron(self, hf, dims):
            (fc1,) = super().to_megatron(hf, dims)
            return [torch.cat(fc1.chunk(2, dim=0)[::-1])]

    def swapped(row):
        if isinstance(row, GroupedExperts) and isinstance(row.inner, InterleavedGatedMLP):
            return GroupedExperts(GateUpSwapped(row.inner.megatron, row.inner.hf))
        return row

    def untransposed(row):
        if isinstance(row, GroupedExperts) and isinstance(row.inner, TransposedRowParallel):
            return GroupedExperts(RowParallel(row.inner.megatron, row.inner.hf))
        return row

    family = registry.get_family("gpt_oss")
    variants = {
        "as saved": family.mappings,
        "gate/up swapped": tuple(map(swapped, family.mappings)),
        "down_proj untransposed": tuple(map(untransposed, family.mappings)),
        "sinks dropped": family.mappings,
    }
    config = AutoConfig.from_pretrained(hf_dir)
    ids = probe_batch(
        config.vocab_size, seq=probe_tokens(config), max_positions=config.max_position_embeddings
    )
    ctx = ParallelContext.initialize(ParallelConfig())
    results = {}
    try:
        for name, rows in variants.items():
            registry._FAMILIES["gpt_oss"] = dataclasses.replace(family, mappings=rows)
            chunks = build_padded_model(config, ctx, dtype=torch.float32)
            bridge = bridge_for_chunks(config, chunks, ctx)
            load_hf_weights(chunks, ctx, bridge, HFCheckpointReader(hf_dir))
            if name == "sinks dropped":  # loaded, then ignored: the attention's plain softmax
                for module in chunks[0].modules():
                    if getattr(module, "softmax_offset", None) is not None:
                        module.softmax_offset = None
            ours = megatron_logits(chunks, ctx, ids, vocab_size=config.vocab_size)
            check = compare_logits(ours, hf_dir, ids, dtype=torch.float32, atol=1e-4)
            results[name] = (check.max_abs_diff, check.tolerance)
    finally:
        registry._FAMILIES["gpt_oss"] = family
        ctx.destroy()
    return results
