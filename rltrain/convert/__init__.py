"""Checkpoint conversion HF ↔ Megatron (and Megatron resharding): the trainer side of the bridge.

The layout knowledge (mappings, readers and writers, the round-trip comparison) is
``megatron_bridge``'s, which imports nothing of rltrain; what needs the trainer lives here.

report.py   MODES, ConversionReport and ConversionError (stdlib only)
model.py    the vocab-padded Megatron model a conversion lays weights into (real or on meta)
ranks.py    one conversion rank: stream, write, verify by round trip and logits
inputs.py   the checks before any rank starts (sources, config, family, layout, destination)
launch.py   run_conversion: check the inputs, spawn the gloo ranks, publish or discard the output
cli.py      ``rltrain convert`` (argparse wiring; no torch on import)
"""
