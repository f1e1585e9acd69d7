"""Megatron-Core backend: the only package of rltrain that imports ``megatron.core`` (pinned 0.16.1).

parallel.py     ParallelContext: torch.distributed + Megatron's TP/PP/VPP/CP/EP/expert-TP/DP groups
cpu_compat.py   the few replacements that let Megatron run on a CPU-only torch (applied only then)
model_config.py HF config -> TransformerConfig and GPTModel options, for any registered family
model.py        GPTModel chunks from an HF config (actor/reference LM head, critic value head)
converters.py   the model-converter seam (LoRA, ...): wrap modules; trainable, checkpointed, exported
local_spec.py   CPU layer spec pieces: packed (THD) attention, sequence-parallel RMSNorm
packed_attention.py  causal attention per sequence of a packed row, no [tokens, tokens] mask
packed_rope.py  RoPE of a packed row as Megatron's THD path, its cos/sin built once a forward
logprobs.py     per-token logprobs and entropy from vocab-parallel logits
micro_batches.py  micro-batching, packing, dynamic batch size, the CP split of packed rows
head_outputs.py logprobs/entropy, values and scores read off a micro-batch's output (fused LM head)
router_replay.py  MoE routing replay: record or replay the routers' top-k in a pass
forward.py      forward / forward-backward over a batch through Megatron's pipeline schedules
train_step.py   DDP, distributed Adam + LR schedule, clipping, skip on non-finite grad norm
checkpoint.py   atomic distributed checkpoints that reshard on load
worker.py       MegatronWorker: the per-role surface the orchestrator calls
"""
