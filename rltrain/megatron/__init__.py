"""Megatron-Core backend: the only package of rltrain that imports ``megatron.core`` (pinned 0.16.1).

parallel.py     ParallelContext: torch.distributed + Megatron's TP/PP/VPP/CP/EP/expert-TP/DP groups
cpu_compat.py   the few replacements that let Megatron run on a CPU-only torch (applied only then)
model.py        GPTModel chunks from an HF config (actor/reference LM head, critic value head)
local_spec.py   CPU layer spec pieces: packed (THD) attention, sequence-parallel RMSNorm
packed_attention.py  causal attention per sequence of a packed row, no [tokens, tokens] mask
packed_rope.py  RoPE of a packed row as Megatron's THD path, its cos/sin built once a forward
logprobs.py     per-token logprobs and entropy from vocab-parallel logits
forward.py      micro-batching, packing, dynamic batch size, pipeline schedules
train_step.py   DDP, distributed Adam + LR schedule, clipping, skip on non-finite grad norm
checkpoint.py   atomic distributed checkpoints that reshard on load
worker.py       MegatronWorker: the per-role surface the orchestrator calls
"""
