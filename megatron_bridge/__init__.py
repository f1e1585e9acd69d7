"""The weight bridge: pure knowledge of HF ↔ Megatron ↔ vLLM layouts, importing nothing of rltrain.

Modules import torch (torch.distributed where a collective is the contract), tqdm for progress and,
for reference logits only, transformers; never ``megatron.core``, vLLM, Ray or ``rltrain``
(``tests/unit/test_import_boundaries.py`` enforces it). Callers pass what the trainer owns (the
model chunks, a parallel context with ranks, sizes and groups) as arguments.

family.py, models/, registry.py     a model family: mapping table, architecture facts, tiny preset; one
                                    file per family, keyed by model_type
mappings.py                         typed tensor mappings (replicated, column/row/vocab parallel, QKV, gated MLP, experts)
bridge.py, dims.py, naming.py       a table bound to one model's dimensions; Megatron naming variants
sharding.py                         where each tensor lives in a TP × PP × EP layout
reshard.py, vllm_names.py           the live weight sync's plan per engine rank, under vLLM's names
hf_io.py, dcp_io.py, mcore_view.py  streamed readers/writers of HF and Megatron checkpoints
live.py                             load into / stream out of live Megatron model chunks
convert.py, verify.py               conversion's round-trip comparison, HF writer, reshard source; logits
memory.py                           peak resident memory over a stretch of code

The conversion ranks and the ``rltrain convert`` CLI that use these live in ``rltrain/convert/``.
"""
