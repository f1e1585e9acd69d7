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
