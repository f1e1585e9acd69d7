"""Opt-in fused kernels, each with a pure-PyTorch reference and a parity test (torch only; no
module here imports triton until a Triton implementation is asked for).

fused_logprob.py   LM head + per-token logprobs and entropy over a vocab-parallel output layer,
                   chunked over tokens (never the [tokens, vocab] logits at once), forward and backward
triton_logprob.py  its per-chunk statistics and softmax gradient as Triton kernels (CUDA)
"""
